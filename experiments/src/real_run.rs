//! Running real legs: the target, the drafter and the vLLM FCFS scheduler through
//! `speclab_engine::exec::generate`, and the lossless check of a real manifest.
//!
//! [`RealRunner::load`] loads the target checkpoint, the prompts and the DFlash
//! checkpoints once; [`RealRunner::run_leg`] builds the leg's drafter
//! (`speclab_drafters::DrafterSpec`), its requests (every prompt queued at once, `max_tokens`
//! each), the scheduler (the same FCFS scheduler and config as `speclab generate`, with
//! `max_num_seqs` = the leg's concurrency) and the pool (sized like `speclab generate`:
//! every request at its full length at once, unless `num_blocks` is given or planned from
//! `kv_cache_memory_bytes` by `speclab_engine::exec::plan_run_pool`; with `device: cuda`
//! the planned target store is checked against the device's free memory), runs the
//! engine, and turns the [`EngineRun`] into a [`LegRecord`] with a [`RealLegRecord`].
//! [`RealRunner::verify_leg`] runs `verify_lossless` (greedy, with vs without the drafter).
//!
//! Invariant: the record's numbers are computed from the run only (acceptance from vLLM's
//! counters, verify width and experts from the per-step stats, TTFT from the per-request
//! stats); an engine error is returned with the leg id, never a panic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use speclab_drafters::{DFlash2Weights, DraftMode, DrafterSpec};
use speclab_engine::exec::{
    generate_on, plan_run_pool, verify_lossless_on, EngineOptions, EngineRequest, EngineRun,
    LosslessReport, RunPoolPlan,
};
use speclab_engine::kv::CapPolicy;
use speclab_engine::model::ModelWeights;
use speclab_engine::spec::SamplingParams;
use speclab_engine::EngineError;

use crate::manifest::cap_name;
use crate::real::{RealDrafter, RealLeg, RealSpec};
use crate::record::{digest_tokens, LegRecord, LegStatus, RealLegRecord, SpecRecord};
use crate::{ExperimentError, Result};

/// The loaded inputs of a real manifest.
pub struct RealRunner<'a> {
    pub spec: &'a RealSpec,
    pub target: ModelWeights,
    pub prompts: Vec<Vec<u32>>,
    dflash: BTreeMap<RealDrafter, DFlash2Weights>,
}

pub use speclab_schedulers::fcfs_factory;

/// The result of the lossless check of one drafter x N x concurrency leg.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LosslessLeg {
    /// `drafter=mtp n=2 c=1`.
    pub id: String,
    pub drafter: String,
    pub num_speculative_tokens: u32,
    pub concurrency: usize,
    pub lossless: bool,
    pub num_requests: usize,
    /// Requests whose greedy output with the drafter equals the one without, token for token.
    pub requests_equal: usize,
    pub num_tokens_compared: u64,
    /// First divergence per mismatching request (index, both tokens, the target's margin).
    pub mismatches: Vec<speclab_engine::exec::Mismatch>,
    pub acceptance_rate: f64,
    pub tau: f64,
    pub reference_tokens_per_s: f64,
    pub candidate_tokens_per_s: f64,
    pub wall_s: f64,
}

impl<'a> RealRunner<'a> {
    /// Load the target, the prompts and the DFlash checkpoints the legs use.
    pub fn load(spec: &'a RealSpec, manifest_path: &Path) -> Result<Self> {
        let dir = spec.model_dir();
        let target = ModelWeights::load(&dir)
            .map_err(|e| ExperimentError::engine(format!("real.model {}", dir.display()), e))?;
        let prompts = spec.load_prompts(manifest_path, &target.cfg)?;
        let mut dflash = BTreeMap::new();
        let used: Vec<RealDrafter> = spec.legs().iter().map(|l| l.drafter).collect();
        for d in RealDrafter::ALL
            .into_iter()
            .filter(|d| d.is_dflash() && used.contains(d))
        {
            let p: PathBuf = spec
                .drafter_dir(d)
                .ok_or_else(|| ExperimentError::Invalid {
                    path: manifest_path.to_path_buf(),
                    field: "real.drafter_dirs".into(),
                    msg: format!("drafter `{}` needs its checkpoint directory", d.name()),
                })?;
            let w = DFlash2Weights::load_for_target(&p, &target.cfg).map_err(|e| {
                ExperimentError::engine(
                    format!("real.drafter_dirs.{} {}", d.name(), p.display()),
                    e,
                )
            })?;
            dflash.insert(d, w);
        }
        Ok(Self {
            spec,
            target,
            prompts,
            dflash,
        })
    }

    /// The requests of every leg: one per prompt, ids 0.., `max_tokens` each.
    pub fn requests(&self) -> Vec<EngineRequest> {
        self.prompts
            .iter()
            .enumerate()
            .map(|(i, p)| EngineRequest {
                id: i as u64,
                prompt: p.clone(),
                max_tokens: self.spec.max_tokens,
            })
            .collect()
    }

    /// The drafter of a leg (`cap`: its DFlash sliding-window group's cap policy).
    pub fn drafter(
        &self,
        d: RealDrafter,
        n: u32,
        cap: CapPolicy,
    ) -> speclab_engine::Result<DrafterSpec> {
        let s = self.spec;
        let n = n as usize;
        let cfg = &self.target.cfg;
        match d {
            RealDrafter::None => Ok(DrafterSpec::none()),
            RealDrafter::Ngram => DrafterSpec::ngram(n, s.ngram_min, s.ngram_max),
            RealDrafter::Mtp => DrafterSpec::mtp(cfg, n),
            RealDrafter::Dflash2 | RealDrafter::Dflash1 => {
                let w = self.dflash.get(&d).cloned().ok_or_else(|| {
                    EngineError::InvalidDrafterConfig {
                        drafter: d.name().into(),
                        reason: "no checkpoint loaded".into(),
                    }
                })?;
                let mode = if d == RealDrafter::Dflash2 {
                    DraftMode::V2
                } else {
                    DraftMode::V1
                };
                DrafterSpec::dflash(w, cfg, n, mode, s.drafter_block_size, cap)
            }
        }
    }

    /// Engine options of a leg: the pool is `num_blocks`, or planned from
    /// `kv_cache_memory_bytes` for this leg's layout (returned beside the options), or
    /// else the drafter factory's default (every request at its full length, as
    /// `speclab generate` sizes it).
    pub fn options(
        &self,
        reqs: &[EngineRequest],
        spec: &DrafterSpec,
        temperature: f32,
        collect_router: bool,
    ) -> speclab_engine::Result<(EngineOptions, Option<RunPoolPlan>)> {
        let s = self.spec;
        let mml = s
            .max_model_len
            .unwrap_or(self.target.cfg.max_position_embeddings as u64);
        let need = spec.default_num_blocks(s.block_size, mml, reqs);
        let mut opts = EngineOptions {
            block_size: s.block_size,
            num_blocks: s.num_blocks.unwrap_or(need),
            max_model_len: s.max_model_len,
            sampling: SamplingParams::random(temperature),
            seed: s.seed,
            ignore_eos: s.ignore_eos,
            collect_router,
            max_steps: s.max_steps,
            check_allocator: true,
        };
        let plan = match s.kv_cache_memory_bytes {
            Some(bytes) => {
                let p = plan_run_pool(&self.target.cfg, spec, &opts, bytes)?;
                opts.num_blocks = p.plan.num_blocks;
                Some(p)
            }
            None => None,
        };
        Ok((opts, plan))
    }

    /// With `device: cuda` and a planned pool: the target's store for it must fit the
    /// device's free memory now (cuMemGetInfo); on the CPU nothing is checked.
    fn check_device_memory(&self, plan: Option<&RunPoolPlan>) -> Result<()> {
        let (crate::real::RealDevice::Cuda, Some(p)) = (self.spec.device, plan) else {
            return Ok(());
        };
        let (free, total) = speclab_cuda::device::mem_info(0)
            .map_err(|e| ExperimentError::engine("real.device cuda", EngineError::from(e)))?;
        let need = p.target_store_bytes();
        if need > free {
            return Err(ExperimentError::engine(
                "real.kv_cache_memory_bytes",
                EngineError::InsufficientKvMemory(format!(
                    "the planned pool ({} blocks x {} B of the target's store = {need} B) does not fit the device's free memory ({free} of {total} B)",
                    p.plan.num_blocks, p.target_store_bytes_per_block
                )),
            ));
        }
        Ok(())
    }

    /// MoE layers x routed experts of the target: the most (layer, expert) pairs a step can touch.
    pub fn expert_slots(&self) -> u64 {
        let c = &self.target.cfg;
        ((0..c.num_hidden_layers)
            .filter(|&i| c.is_moe_layer(i))
            .count()
            * c.n_routed_experts) as u64
    }

    /// The drafter factory for `real.device`: on `cuda` the DFlash drafters run on the
    /// device too (`speclab_cuda::CudaDFlash2`), every other kind is the spec's own.
    fn drafter_factory<'s>(
        &self,
        spec: &'s DrafterSpec,
        on_device: &'s speclab_cuda::CudaDrafterSpec<'s>,
    ) -> &'s dyn speclab_engine::exec::DrafterFactory {
        match self.spec.device {
            crate::real::RealDevice::Cpu => spec,
            crate::real::RealDevice::Cuda => on_device,
        }
    }

    /// The target backend `real.device` names.
    fn backend(&self) -> Box<dyn speclab_engine::backend::BackendFactory> {
        match self.spec.device {
            crate::real::RealDevice::Cpu => Box::new(speclab_engine::backend::CpuBackend),
            crate::real::RealDevice::Cuda => Box::new(speclab_cuda::CudaFactory::default()),
        }
    }

    /// Run one leg and record it.
    pub fn run_leg(&self, leg: &RealLeg) -> Result<LegRecord> {
        let t0 = Instant::now();
        let ctx = format!("leg {}", leg.id);
        let eng = |e| ExperimentError::engine(ctx.clone(), e);
        let spec = self
            .drafter(leg.drafter, leg.num_speculative_tokens, leg.cap)
            .map_err(eng)?;
        let reqs = self.requests();
        let (opts, plan) = self
            .options(&reqs, &spec, leg.temperature, self.spec.collect_router)
            .map_err(eng)?;
        self.check_device_memory(plan.as_ref())?;
        let mut make = fcfs_factory(leg.concurrency, self.spec.max_num_batched_tokens);
        let backend = self.backend();
        let on_device = speclab_cuda::CudaDrafterSpec(&spec);
        let run = generate_on(
            backend.as_ref(),
            &self.target,
            self.drafter_factory(&spec, &on_device),
            &reqs,
            &opts,
            &mut make,
        )
        .map_err(eng)?;
        let mut real = self.real_record(leg, &reqs, &opts, &run);
        real.kv_plan = plan;
        let status = if run.wedged.is_some() {
            LegStatus::Wedged
        } else if !run.rejected.is_empty() {
            LegStatus::Rejected
        } else if run.hit_step_limit {
            LegStatus::StepLimit
        } else {
            LegStatus::Completed
        };
        let notes: Vec<String> = run
            .wedged
            .iter()
            .cloned()
            .chain(run.rejected.iter().cloned())
            .chain(
                run.allocator_violation
                    .iter()
                    .map(|v| format!("allocator check: {v}")),
            )
            .collect();
        Ok(LegRecord {
            id: leg.id.clone(),
            block_size: Some(self.spec.block_size),
            cap: cap_name(leg.cap).to_string(),
            num_blocks: opts.num_blocks,
            usable_blocks: run.kv_usable_blocks,
            group_names: vec![],
            prompts: reqs.iter().map(|r| r.prompt.len() as u64).collect(),
            status,
            admissions: vec![],
            steps: run.num_steps,
            preemptions: run.preemptions,
            finished: run.requests.iter().filter(|r| r.finish.is_some()).count() as u64,
            peak_held_per_group: vec![],
            peak_total_held: 0,
            spec: SpecRecord {
                num_drafts: run.spec.num_drafts,
                num_draft_tokens: run.spec.num_draft_tokens,
                num_accepted_tokens: run.spec.num_accepted_tokens,
                accepted_per_position: run.spec.accepted_per_position.clone(),
                draft_acceptance_rate: (run.spec.num_draft_tokens > 0)
                    .then_some(run.acceptance_rate),
                mean_acceptance_length: (run.spec.num_drafts > 0).then_some(run.tau),
            },
            bound: None,
            note: (!notes.is_empty()).then(|| notes.join("; ")),
            wall_ms: t0.elapsed().as_secs_f64() * 1e3,
            real: Some(real),
            sim_time: None,
            concurrency: self.spec.record_concurrency.then(|| {
                let mut c = crate::record::ConcurrencyCounter::default();
                run.steps.iter().for_each(|st| c.observe(st));
                c.record()
            }),
        })
    }

    fn real_record(
        &self,
        leg: &RealLeg,
        reqs: &[EngineRequest],
        opts: &EngineOptions,
        run: &EngineRun,
    ) -> RealLegRecord {
        let decode: Vec<_> = run.steps.iter().filter(|s| s.verify_tokens > 0).collect();
        let mean = |xs: &[f64]| (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64);
        let widths: Vec<f64> = decode.iter().map(|s| s.verify_tokens as f64).collect();
        let experts: Vec<u64> = decode.iter().filter_map(|s| s.verify_experts).collect();
        let ttft_steps: Vec<f64> = run
            .requests
            .iter()
            .filter_map(|r| r.ttft_steps)
            .map(|x| x as f64)
            .collect();
        let ttft_s: Vec<f64> = run.requests.iter().filter_map(|r| r.ttft_s).collect();
        let mut finish = BTreeMap::new();
        for r in &run.requests {
            let k = match r.finish {
                Some(f) => serde_json::to_value(f)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_else(|| format!("{f:?}")),
                None => "unfinished".into(),
            };
            *finish.entry(k).or_insert(0u64) += 1;
        }
        RealLegRecord {
            drafter: leg.drafter.name().into(),
            num_speculative_tokens: leg.num_speculative_tokens,
            concurrency: leg.concurrency,
            temperature: leg.temperature,
            num_requests: reqs.len() as u64,
            prompt_tokens: reqs.iter().map(|r| r.prompt.len() as u64).sum(),
            max_tokens: self.spec.max_tokens,
            num_blocks: opts.num_blocks,
            num_drafts: run.spec.num_drafts,
            num_draft_tokens: run.spec.num_draft_tokens,
            num_accepted_tokens: run.spec.num_accepted_tokens,
            accepted_per_position: run.spec.accepted_per_position.clone(),
            acceptance_per_position: run.per_position.clone(),
            draft_acceptance_rate: (run.spec.num_draft_tokens > 0).then_some(run.acceptance_rate),
            tau: (run.spec.num_drafts > 0).then_some(run.tau),
            output_tokens: run.output_tokens,
            steps: run.num_steps,
            decode_steps: decode.len() as u64,
            tokens_per_s: run.tokens_per_s,
            wall_s: run.wall_s,
            mean_verify_width: mean(&widths),
            max_verify_width: decode.iter().map(|s| s.verify_tokens).max().unwrap_or(0),
            mean_verify_experts: mean(&experts.iter().map(|&x| x as f64).collect::<Vec<_>>()),
            max_verify_experts: experts.iter().copied().max(),
            expert_slots: self.expert_slots(),
            mean_ttft_steps: mean(&ttft_steps),
            mean_ttft_s: mean(&ttft_s),
            max_ttft_s: ttft_s
                .iter()
                .copied()
                .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x)))),
            complete: run.complete(),
            wedged: run.wedged.clone(),
            hit_step_limit: run.hit_step_limit,
            preemptions: run.preemptions,
            finish,
            output_digests: run
                .requests
                .iter()
                .map(|r| digest_tokens(&r.output))
                .collect(),
            allocator_violation: run.allocator_violation.clone(),
            kv_plan: None,
        }
    }

    /// The lossless check of drafter `d` at N = `n` and concurrency `c` (greedy).
    pub fn verify_leg(&self, l: &LosslessSpec) -> Result<(LosslessLeg, LosslessReport)> {
        let (d, n, c) = (l.drafter, l.num_speculative_tokens, l.concurrency);
        let id = format!("drafter={} n={n} c={c}{}", d.name(), l.id_suffix);
        let eng = |e| ExperimentError::engine(format!("verify-lossless {id}"), e);
        let t0 = Instant::now();
        let spec = self.drafter(d, n, l.cap).map_err(eng)?;
        let reqs = self.requests();
        let (opts, plan) = self.options(&reqs, &spec, 0.0, false).map_err(eng)?;
        self.check_device_memory(plan.as_ref())?;
        let mut make = fcfs_factory(c, self.spec.max_num_batched_tokens);
        let backend = self.backend();
        let on_device = speclab_cuda::CudaDrafterSpec(&spec);
        let report = verify_lossless_on(
            backend.as_ref(),
            &self.target,
            self.drafter_factory(&spec, &on_device),
            &reqs,
            &opts,
            &mut make,
        )
        .map_err(eng)?;
        let leg = LosslessLeg {
            id,
            drafter: d.name().into(),
            num_speculative_tokens: n,
            concurrency: c,
            lossless: report.is_lossless(),
            num_requests: report.num_requests,
            requests_equal: report.num_requests - report.mismatches.len(),
            num_tokens_compared: report.num_tokens_compared,
            mismatches: report.mismatches.clone(),
            acceptance_rate: report.candidate.acceptance_rate,
            tau: report.candidate.tau,
            reference_tokens_per_s: report.reference.tokens_per_s,
            candidate_tokens_per_s: report.candidate.tokens_per_s,
            wall_s: t0.elapsed().as_secs_f64(),
        };
        Ok((leg, report))
    }
}

/// The legs of the lossless check of a real manifest: every drafter but `none` x its N x
/// concurrency x (under a `caps` axis, DFlash only) cap (temperatures are not used: the
/// check is greedy).
pub fn lossless_legs(spec: &RealSpec) -> Vec<LosslessSpec> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for l in spec.legs() {
        let key = (
            l.drafter,
            l.num_speculative_tokens,
            l.concurrency,
            crate::manifest::cap_name(l.cap),
        );
        if l.drafter != RealDrafter::None && seen.insert(key) {
            let suffix = spec.cap_suffix(l.drafter, l.cap);
            out.push(LosslessSpec {
                drafter: l.drafter,
                num_speculative_tokens: l.num_speculative_tokens,
                concurrency: l.concurrency,
                cap: l.cap,
                id_suffix: suffix,
            });
        }
    }
    out
}

/// One verify-lossless check of a real manifest: a drafter, N, concurrency and (for DFlash
/// drafters under a `caps` axis) the cap policy of its window group.
#[derive(Debug, Clone, PartialEq)]
pub struct LosslessSpec {
    pub drafter: RealDrafter,
    pub num_speculative_tokens: u32,
    pub concurrency: usize,
    pub cap: CapPolicy,
    /// ` cap=<name>` under a `caps` axis, else empty (as the run's leg ids).
    pub id_suffix: String,
}
