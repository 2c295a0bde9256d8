//! `speclab quantize`: a bf16 checkpoint in, a W4A16 (compressed-tensors
//! pack-quantized) checkpoint out, with per-matrix GPTQ-vs-RTN errors.
//!
//! Recipe (the model card's "Calibration: ... sequential per-layer GPTQ",
//! scaled down): the routed experts of MoE layers are quantized one layer at a
//! time, in order. For layer l the calibration sequences run through the model
//! whose layers < l are already quantized (so each layer's Hessians see the
//! inputs it will see at inference, as llm-compressor's sequential pipeline
//! does); every routed expert's `gate_proj`/`up_proj` get H = 2/n X^T X of the
//! rows routed to it, `down_proj` the same of its SwiGLU activations; then each
//! matrix is quantized (GPTQ, or RTN for `--method rtn`) and swapped into the
//! model. Experts that receive no calibration rows fall back to RTN (reported).
//! Everything else (attention, KDA, router, shared experts, dense prefix, MTP
//! layer, embeddings, lm_head) stays bf16, as the card's ignore list says.
//!
//! Invariants: the output loads with `ModelWeights::load` and its
//! `quantization_config` is `QuantizationConfig::for_model` (docs/model.md §8);
//! the per-matrix report compares GPTQ and RTN on the same Hessian.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;
use speclab_engine::kv::{AllocOutcome, KvCacheManager};
use speclab_engine::model::weights::Ffn;
use speclab_engine::model::{
    ExpertInput, ExpertObserver, ForwardOptions, Linear, LogitsRows, ModelRunner, ModelWeights,
    SeqChunk,
};
use speclab_engine::ReqSlot;

use crate::gptq::{gptq_quantize, reconstruction_error, GptqConfig, Hessian};
use crate::rtn::quantize_rtn;
use crate::{QuantError, Result};

/// Quantization method.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Method {
    Gptq(GptqConfig),
    Rtn,
}

/// One quantized matrix in the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MatrixReport {
    pub module: String,
    pub shape: [usize; 2],
    /// Calibration rows that reached this matrix.
    pub calib_rows: u64,
    /// GPTQ objective tr((W - W_hat) H (W - W_hat)^T) / N of the method used.
    pub proxy_loss: f64,
    /// The same for RTN on the same Hessian (the baseline).
    pub rtn_proxy_loss: f64,
    /// ||W - W_hat||_F / ||W||_F of the method used.
    pub rel_frobenius: f64,
    pub rtn_rel_frobenius: f64,
    /// "gptq", "rtn", or "rtn (no calibration rows)".
    pub method: String,
    pub dampening_used: Option<f64>,
}

/// What `quantize_model` did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuantizeReport {
    pub method: String,
    pub calib_sequences: usize,
    pub calib_tokens: usize,
    pub matrices: Vec<MatrixReport>,
    /// Sum over matrices of proxy_loss / sum of rtn_proxy_loss.
    pub total_proxy_ratio_vs_rtn: f64,
    pub files: Vec<String>,
}

/// Inputs of a quantization job.
pub struct QuantizeJob<'a> {
    pub model_dir: &'a Path,
    pub out_dir: &'a Path,
    /// Calibration token sequences.
    pub calib: &'a [Vec<u32>],
    pub method: Method,
    /// Shard files above this size (the GPU machine returns files of at most 16 MiB).
    pub max_shard_bytes: Option<usize>,
}

#[derive(Default)]
struct Collector {
    layer: usize,
    /// (expert, input) -> Hessian and the rows seen.
    h: HashMap<(usize, ExpertInput), (Hessian, u64)>,
    err: Option<QuantError>,
}

impl ExpertObserver for Collector {
    fn observe(&mut self, layer: usize, expert: usize, input: ExpertInput, x: &[f32], rows: usize) {
        if layer != self.layer || self.err.is_some() || rows == 0 {
            return;
        }
        let k = x.len() / rows;
        let entry = match self.h.entry((expert, input)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => match Hessian::new(k) {
                Ok(h) => v.insert((h, 0)),
                Err(e) => {
                    self.err = Some(e);
                    return;
                }
            },
        };
        if let Err(e) = entry.0.add_batch(x) {
            self.err = Some(e);
        }
        entry.1 += rows as u64;
    }
}

/// Run every calibration sequence through `weights`, collecting layer `layer`'s expert Hessians.
fn collect(weights: &ModelWeights, layer: usize, calib: &[Vec<u32>]) -> Result<Collector> {
    let cfg = &weights.cfg;
    let longest = calib.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let bs = 16u32;
    let blocks = (longest as u32).div_ceil(bs) + 4;
    let layout = cfg.kv_layout(bs, 0, blocks + 4)?;
    let mut kv = KvCacheManager::from_layout(&layout)?;
    let mut runner = ModelRunner::new(weights.clone(), &kv)?;
    let mut col = Collector {
        layer,
        ..Collector::default()
    };
    let opts = ForwardOptions {
        logits: LogitsRows::LastPerChunk,
        ..ForwardOptions::default()
    };
    let slot = ReqSlot(0);
    for (i, seq) in calib.iter().enumerate() {
        if seq.is_empty() {
            continue;
        }
        let n = seq.len() as u64;
        match kv.allocate_whole(slot, n)? {
            AllocOutcome::Allocated(_) => {}
            AllocOutcome::NoFit => {
                return Err(QuantError::Config(format!(
                    "calibration sequence {i} ({n} tokens) does not fit the KV pool"
                )))
            }
        }
        runner.forward_observed(
            &kv,
            &[SeqChunk {
                slot,
                tokens: seq,
                start_pos: 0,
                snapshot: false,
            }],
            &opts,
            &mut col,
        )?;
        kv.free(slot);
        runner.release(slot);
        if let Some(e) = col.err.take() {
            return Err(e);
        }
    }
    Ok(col)
}

fn quantize_one(
    module: String,
    w: &[f32],
    n: usize,
    k: usize,
    hs: Option<&(Hessian, u64)>,
    method: Method,
) -> Result<(Linear, MatrixReport)> {
    let rtn = quantize_rtn(w, n, k)?;
    let rtn_w = rtn.dequantize()?;
    let Some((h, rows)) = hs else {
        // No calibration row reached this expert: RTN, with no Hessian to score it.
        let e = w
            .iter()
            .zip(&rtn_w)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt()
            / w.iter()
                .map(|a| (*a as f64).powi(2))
                .sum::<f64>()
                .sqrt()
                .max(f64::MIN_POSITIVE);
        let rep = MatrixReport {
            module,
            shape: [n, k],
            calib_rows: 0,
            proxy_loss: f64::NAN,
            rtn_proxy_loss: f64::NAN,
            rel_frobenius: e,
            rtn_rel_frobenius: e,
            method: "rtn (no calibration rows)".into(),
            dampening_used: None,
        };
        return Ok((rtn.to_linear()?, rep));
    };
    let rtn_err = reconstruction_error(w, &rtn_w, n, k, h)?;
    let (t, name, damp) = match method {
        Method::Rtn => (rtn, "rtn", None),
        Method::Gptq(cfg) => {
            let out = gptq_quantize(w, n, k, h, &cfg)?;
            let d = out.dampening_used;
            (out.tensor, "gptq", Some(d))
        }
    };
    let err = reconstruction_error(w, &t.dequantize()?, n, k, h)?;
    let rep = MatrixReport {
        module,
        shape: [n, k],
        calib_rows: *rows,
        proxy_loss: err.proxy_loss,
        rtn_proxy_loss: rtn_err.proxy_loss,
        rel_frobenius: err.rel_frobenius,
        rtn_rel_frobenius: rtn_err.rel_frobenius,
        method: name.into(),
        dampening_used: damp,
    };
    Ok((t.to_linear()?, rep))
}

/// Quantize the routed experts of a bf16 checkpoint; `progress` gets one line per layer.
pub fn quantize_model(
    job: &QuantizeJob<'_>,
    progress: &mut dyn FnMut(&str),
) -> Result<QuantizeReport> {
    let mut weights = ModelWeights::load(job.model_dir)?;
    if weights.cfg.quantization_config.is_some() {
        return Err(QuantError::Config(format!(
            "{}: the checkpoint is already quantized",
            job.model_dir.display()
        )));
    }
    if job.calib.iter().all(Vec::is_empty) && matches!(job.method, Method::Gptq(_)) {
        return Err(QuantError::Config("GPTQ needs calibration tokens".into()));
    }
    let vocab = weights.cfg.vocab_size as u32;
    for (i, s) in job.calib.iter().enumerate() {
        if let Some(&bad) = s.iter().find(|&&t| t >= vocab) {
            return Err(QuantError::Config(format!(
                "calibration sequence {i}: token id {bad} >= vocab_size {vocab}"
            )));
        }
    }
    let mut matrices = Vec::new();
    let moe_layers: Vec<usize> = (0..weights.layers.len())
        .filter(|&i| matches!(weights.layers[i].ffn, Ffn::Moe(_)))
        .collect();
    for &l in &moe_layers {
        let col = if matches!(job.method, Method::Gptq(_)) || !job.calib.is_empty() {
            Some(collect(&weights, l, job.calib)?)
        } else {
            None
        };
        let Ffn::Moe(moe) = &mut weights.layers[l].ffn else {
            continue;
        };
        for (j, ex) in moe.experts.iter_mut().enumerate() {
            for (proj, lin, input) in [
                ("gate_proj", &mut ex.gate, ExpertInput::GateUp),
                ("up_proj", &mut ex.up, ExpertInput::GateUp),
                ("down_proj", &mut ex.down, ExpertInput::Down),
            ] {
                let (n, k) = match lin {
                    Linear::Dense {
                        out_features,
                        in_features,
                        ..
                    } => (*out_features, *in_features),
                    Linear::W4A16 { .. } => {
                        return Err(QuantError::Config(format!(
                            "layer {l} expert {j} {proj} is already quantized"
                        )))
                    }
                };
                let w = lin.weight_f32();
                let hs = col.as_ref().and_then(|c| c.h.get(&(j, input)));
                let (q, rep) = quantize_one(
                    format!("model.layers.{l}.mlp.experts.{j}.{proj}"),
                    &w,
                    n,
                    k,
                    hs,
                    job.method,
                )?;
                *lin = q;
                matrices.push(rep);
            }
        }
        progress(&format!(
            "layer {l}: {} experts quantized",
            moe.experts.len()
        ));
    }
    weights.cfg = weights.cfg.clone().with_quantization();
    let files = weights.save_sharded(job.out_dir, job.max_shard_bytes)?;
    let scored: Vec<&MatrixReport> = matrices
        .iter()
        .filter(|m| m.proxy_loss.is_finite())
        .collect();
    let num: f64 = scored.iter().map(|m| m.proxy_loss).sum();
    let den: f64 = scored.iter().map(|m| m.rtn_proxy_loss).sum();
    Ok(QuantizeReport {
        method: match job.method {
            Method::Gptq(_) => "gptq".into(),
            Method::Rtn => "rtn".into(),
        },
        calib_sequences: job.calib.len(),
        calib_tokens: job.calib.iter().map(Vec::len).sum(),
        matrices,
        total_proxy_ratio_vs_rtn: if den > 0.0 { num / den } else { f64::NAN },
        files,
    })
}
