//! Sharded sweeps: one manifest's legs split over N machines, and the merge of their records.
//!
//! Ownership: shard `I` of `N` owns the legs whose index `i` in manifest order has
//! `i % N == I` (round robin, so a sweep ordered by size spreads its long legs). Leg ids
//! and their order come from the manifest, so the split is the same on every machine and
//! every rerun.
//!
//! Where the shard comes from ([`resolve`]), first match wins:
//! 1. `--no-shard`: no sharding, whatever the environment says;
//! 2. `--shard I/N`;
//! 3. Slurm job arrays: `SLURM_ARRAY_TASK_ID` with `SLURM_ARRAY_TASK_COUNT`; the index is
//!    `(ID - SLURM_ARRAY_TASK_MIN) / SLURM_ARRAY_TASK_STEP` (MIN 0 and STEP 1 when unset),
//!    so `--array=1-3` and `--array=0-10:2` work; an arbitrary id list (`--array=1,5,7`)
//!    does not map onto 0..N and is refused when an index comes out >= N;
//! 4. Kubernetes Indexed Jobs: `JOB_COMPLETION_INDEX`. Kubernetes gives only the index,
//!    so the count comes from `--shard-count N` or the `SPECLAB_SHARD_COUNT` variable
//!    (set it to the Job's `completions`).
//!
//! With none of these the run is not sharded and behaves exactly as before. Bad input
//! (I >= N, N = 0, a non-number) is an error naming the flag or variable and the value.
//!
//! Records: a shard writes `runs/<name>.shard-I-of-N.json` (unless `--out`), a normal
//! record (locked, atomic, resumable) holding only its legs, with `shard: {index, count}`
//! (absent from unsharded records, so old records load and unsharded ones are unchanged).
//! [`merge`] checks that the shard records come from the same manifest text, agree on N,
//! hold every index 0..N exactly once, are each complete, hold exactly the legs their
//! index owns (so no leg twice) and together cover every leg of the manifest; it refuses
//! otherwise with an error naming the file and the problem. The merged record is the
//! unsharded run's record: legs in manifest order, `complete`, no `shard`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::manifest::Manifest;
use crate::record::{self, RunRecord};
use crate::{ExperimentError, Result};

/// The Kubernetes count variable (Kubernetes itself gives only `JOB_COMPLETION_INDEX`).
pub const COUNT_VAR: &str = "SPECLAB_SHARD_COUNT";

/// One shard of a sweep: `index` of `count` (0-based, `index < count`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// A checked shard; `what` names the flag or variable for the error.
    pub fn new(index: usize, count: usize, what: &str) -> Result<Self> {
        if count == 0 {
            return Err(bad(
                what,
                format!("the shard count is 0 (index {index}); expected N >= 1"),
            ));
        }
        if index >= count {
            return Err(bad(
                what,
                format!("shard index {index} is not below the count {count}; expected 0 <= I < N"),
            ));
        }
        Ok(Self { index, count })
    }

    /// Parse `I/N` (the `--shard` flag).
    pub fn parse(spec: &str) -> Result<Self> {
        let what = "--shard";
        let Some((i, n)) = spec.split_once('/') else {
            return Err(bad(what, format!("{spec:?}: expected I/N, e.g. 0/3")));
        };
        Self::new(number(what, i)?, number(what, n)?, what)
    }

    /// Whether this shard owns the leg at `index` in manifest order.
    pub fn owns(&self, index: usize) -> bool {
        index % self.count == self.index
    }

    /// The shard record's default path: `runs/<name>.shard-I-of-N.json`.
    pub fn record_path(&self, name: &str) -> PathBuf {
        PathBuf::from("runs").join(format!(
            "{name}.shard-{}-of-{}.json",
            self.index, self.count
        ))
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

fn bad(what: &str, msg: String) -> ExperimentError {
    ExperimentError::Config {
        what: what.to_string(),
        msg,
    }
}

fn number(what: &str, s: &str) -> Result<usize> {
    s.trim()
        .parse()
        .map_err(|_| bad(what, format!("{s:?} is not a non-negative integer")))
}

/// The shard options of `speclab run`.
#[derive(Debug, Clone, Default)]
pub struct ShardArgs<'a> {
    /// `--shard I/N`.
    pub shard: Option<&'a str>,
    /// `--shard-count N` (with `JOB_COMPLETION_INDEX`).
    pub count: Option<usize>,
    /// `--no-shard`.
    pub no_shard: bool,
}

/// The shard of this run (module doc for the order); `env` reads a variable.
pub fn resolve(a: &ShardArgs<'_>, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Shard>> {
    if a.no_shard {
        return Ok(None);
    }
    if let Some(s) = a.shard {
        let shard = Shard::parse(s)?;
        if let Some(n) = a.count.filter(|&n| n != shard.count) {
            return Err(bad("--shard-count", format!("{n} contradicts --shard {s}")));
        }
        return Ok(Some(shard));
    }
    if let Some(id) = env("SLURM_ARRAY_TASK_ID") {
        return slurm(&id, env).map(Some);
    }
    if let Some(idx) = env("JOB_COMPLETION_INDEX") {
        let index = number("JOB_COMPLETION_INDEX", &idx)?;
        let count = match (a.count, env(COUNT_VAR)) {
            (Some(n), _) => Shard::new(index, n, "--shard-count")?.count,
            (None, Some(n)) => number(COUNT_VAR, &n)?,
            (None, None) => {
                return Err(bad(
                    "JOB_COMPLETION_INDEX",
                    format!("{idx} is set but the shard count is not: pass --shard-count N or set {COUNT_VAR} to the Job's completions"),
                ))
            }
        };
        return Shard::new(index, count, "JOB_COMPLETION_INDEX").map(Some);
    }
    if let Some(n) = a.count {
        return Err(bad(
            "--shard-count",
            format!("{n} given but no shard index (--shard I/N, SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX)"),
        ));
    }
    Ok(None)
}

fn slurm(id: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Shard> {
    let what = "SLURM_ARRAY_TASK_ID";
    let id = number(what, id)?;
    let Some(count) = env("SLURM_ARRAY_TASK_COUNT") else {
        return Err(bad(
            "SLURM_ARRAY_TASK_COUNT",
            format!("not set (SLURM_ARRAY_TASK_ID is {id}); run inside an sbatch --array job or pass --shard I/N"),
        ));
    };
    let count = number("SLURM_ARRAY_TASK_COUNT", &count)?;
    let min = match env("SLURM_ARRAY_TASK_MIN") {
        Some(m) => number("SLURM_ARRAY_TASK_MIN", &m)?,
        None => 0,
    };
    let step = match env("SLURM_ARRAY_TASK_STEP") {
        Some(s) => number("SLURM_ARRAY_TASK_STEP", &s)?.max(1),
        None => 1,
    };
    let Some(off) = id.checked_sub(min) else {
        return Err(bad(
            what,
            format!("{id} is below SLURM_ARRAY_TASK_MIN {min}"),
        ));
    };
    if count == 0 {
        return Err(bad(
            "SLURM_ARRAY_TASK_COUNT",
            "the shard count is 0; expected N >= 1".into(),
        ));
    }
    let index = off / step;
    if index >= count {
        return Err(bad(
            what,
            format!("{id} (min {min}, step {step}) gives shard index {index}, not below SLURM_ARRAY_TASK_COUNT {count}; use a contiguous --array range such as 0-{}", count - 1),
        ));
    }
    Ok(Shard { index, count })
}

/// The leg ids of a manifest text, in manifest order (`path` for errors).
fn leg_ids(path: &Path, text: &str) -> Result<Vec<String>> {
    let m: Manifest = crate::manifest::parse_ron(path, text)?;
    Ok(match &m.real {
        Some(r) => r.legs().into_iter().map(|l| l.id).collect(),
        None => m.legs()?.into_iter().map(|l| l.id).collect(),
    })
}

fn refuse(path: &Path, field: &str, msg: String) -> ExperimentError {
    ExperimentError::Invalid {
        path: path.to_path_buf(),
        field: field.into(),
        msg,
    }
}

/// The default merged record path: the first shard's path without `.shard-I-of-N`.
pub fn merged_path(shard_path: &Path) -> Option<PathBuf> {
    let name = shard_path.file_name()?.to_string_lossy().into_owned();
    let (stem, rest) = name.rsplit_once(".shard-")?;
    let ext = rest.split_once('.').map(|(_, e)| e).unwrap_or("json");
    Some(shard_path.with_file_name(format!("{stem}.{ext}")))
}

/// Check one shard record against the first one; its shard.
fn check_shard(path: &Path, r: &RunRecord, first: (&Path, &RunRecord)) -> Result<Shard> {
    let Some(s) = r.shard else {
        return Err(refuse(path, "shard", "not a shard record (no `shard` field); merge takes the records of `speclab run --shard I/N`".into()));
    };
    let (fp, f) = first;
    if r.manifest_text != f.manifest_text {
        return Err(refuse(
            path,
            "manifest_text",
            format!(
                "made from a different manifest text than {} (both must be shards of one manifest)",
                fp.display()
            ),
        ));
    }
    if Some(s.count) != f.shard.map(|x| x.count) {
        return Err(refuse(
            path,
            "shard",
            format!(
                "shard {s} but {} is shard {}; every shard must split into the same count",
                fp.display(),
                f.shard.map(|x| x.to_string()).unwrap_or_default()
            ),
        ));
    }
    if !r.complete {
        return Err(refuse(
            path,
            "complete",
            format!("shard {s} is unfinished; rerun it (`speclab run --shard {s}`) before merging"),
        ));
    }
    if r.notes != f.notes || r.plans != f.plans {
        return Err(refuse(
            path,
            "notes",
            format!("run notes or plans differ from {}", fp.display()),
        ));
    }
    Ok(s)
}

/// Merge shard records into the record of the unsharded run (module doc for the checks).
pub fn merge(paths: &[PathBuf]) -> Result<RunRecord> {
    let recs: Vec<(PathBuf, RunRecord)> = paths
        .iter()
        .map(|p| RunRecord::load(p).map(|r| (p.clone(), r)))
        .collect::<Result<_>>()?;
    let Some((fp, first)) = recs.first() else {
        return Err(bad("merge", "no shard records given".into()));
    };
    let mut by_index: Vec<Option<&Path>> = Vec::new();
    for (p, r) in &recs {
        let s = check_shard(p, r, (fp, first))?;
        by_index.resize(s.count, None);
        if let Some(other) = by_index[s.index] {
            return Err(refuse(
                p,
                "shard",
                format!("shard {s} is given twice (also {})", other.display()),
            ));
        }
        by_index[s.index] = Some(p);
    }
    let missing: Vec<String> = (0..by_index.len())
        .filter(|&i| by_index[i].is_none())
        .map(|i| i.to_string())
        .collect();
    if !missing.is_empty() {
        return Err(refuse(
            fp,
            "shard",
            format!(
                "missing shard(s) {} of {}; merge needs every shard record",
                missing.join(", "),
                by_index.len()
            ),
        ));
    }
    let ids = leg_ids(Path::new(&first.manifest_path), &first.manifest_text)?;
    let mut legs = Vec::with_capacity(ids.len());
    for (p, r) in &recs {
        let s = r.shard.unwrap_or(Shard { index: 0, count: 1 });
        for l in &r.legs {
            match ids.iter().position(|x| *x == l.id) {
                Some(i) if s.owns(i) => legs.push((i, l.clone())),
                Some(i) => {
                    return Err(refuse(
                        p,
                        "legs",
                        format!(
                            "leg {:?} (index {i}) belongs to shard {}/{}, not {s}",
                            l.id,
                            i % s.count,
                            s.count
                        ),
                    ))
                }
                None => {
                    return Err(refuse(
                        p,
                        "legs",
                        format!("leg {:?} is not a leg of the manifest", l.id),
                    ))
                }
            }
        }
    }
    legs.sort_by_key(|(i, _)| *i);
    if let Some(w) = legs.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(refuse(
            fp,
            "legs",
            format!("leg {:?} is recorded twice", w[0].1.id),
        ));
    }
    if let Some(i) = (0..ids.len()).find(|i| legs.get(*i).map(|l| l.0) != Some(*i)) {
        return Err(refuse(
            fp,
            "legs",
            format!("leg {:?} (index {i}) is in no shard record", ids[i]),
        ));
    }
    let mut out = first.clone();
    out.legs = legs.into_iter().map(|(_, l)| l).collect();
    out.shard = None;
    out.complete = true;
    out.started_unix_s = recs
        .iter()
        .map(|(_, r)| r.started_unix_s)
        .min()
        .unwrap_or(0);
    out.updated_unix_s = record::now_unix();
    Ok(out)
}

/// Merge and write the record atomically at `out`, under the record lock.
pub fn merge_into(paths: &[PathBuf], out: &Path) -> Result<RunRecord> {
    let merged = merge(paths)?;
    let mut lock = record::RecordLock::open(out)?;
    let _guard = lock.try_lock()?;
    merged.save(out)?;
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    fn res(a: &ShardArgs<'_>, vars: &[(&str, &str)]) -> Result<Option<Shard>> {
        resolve(a, &env(vars))
    }

    fn err(a: &ShardArgs<'_>, vars: &[(&str, &str)]) -> String {
        res(a, vars).unwrap_err().to_string()
    }

    #[test]
    fn flag_parses_and_wins_over_the_environment() {
        let a = ShardArgs {
            shard: Some("1/3"),
            ..Default::default()
        };
        let slurm = [
            ("SLURM_ARRAY_TASK_ID", "2"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ];
        assert_eq!(res(&a, &slurm).unwrap(), Some(Shard { index: 1, count: 3 }));
        assert_eq!(res(&ShardArgs::default(), &[]).unwrap(), None);
        let off = ShardArgs {
            no_shard: true,
            ..Default::default()
        };
        assert_eq!(res(&off, &slurm).unwrap(), None);
    }

    #[test]
    fn bad_flags_name_the_flag_and_value() {
        for (spec, want) in [
            ("3/3", "not below"),
            ("0/0", "count is 0"),
            ("a/3", "\"a\""),
            ("2", "expected I/N"),
        ] {
            let e = err(
                &ShardArgs {
                    shard: Some(spec),
                    ..Default::default()
                },
                &[],
            );
            assert!(
                e.starts_with("--shard: ") && e.contains(want),
                "{spec}: {e}"
            );
        }
        let e = err(
            &ShardArgs {
                shard: Some("0/3"),
                count: Some(4),
                ..Default::default()
            },
            &[],
        );
        assert!(e.starts_with("--shard-count: 4"), "{e}");
        let e = err(
            &ShardArgs {
                count: Some(3),
                ..Default::default()
            },
            &[],
        );
        assert!(e.contains("no shard index"), "{e}");
    }

    #[test]
    fn slurm_variables_with_min_and_step() {
        let d = ShardArgs::default();
        let s = |v: &[(&str, &str)]| res(&d, v).unwrap().unwrap();
        assert_eq!(
            s(&[
                ("SLURM_ARRAY_TASK_ID", "2"),
                ("SLURM_ARRAY_TASK_COUNT", "3")
            ]),
            Shard { index: 2, count: 3 }
        );
        let one_based = [
            ("SLURM_ARRAY_TASK_ID", "3"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
        ];
        assert_eq!(s(&one_based), Shard { index: 2, count: 3 });
        let stepped = [
            ("SLURM_ARRAY_TASK_ID", "4"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
            ("SLURM_ARRAY_TASK_STEP", "2"),
        ];
        assert_eq!(s(&stepped), Shard { index: 2, count: 3 });
        let e = err(
            &d,
            &[
                ("SLURM_ARRAY_TASK_ID", "3"),
                ("SLURM_ARRAY_TASK_COUNT", "3"),
            ],
        );
        assert!(e.starts_with("SLURM_ARRAY_TASK_ID: 3"), "{e}");
        let e = err(
            &d,
            &[
                ("SLURM_ARRAY_TASK_ID", "x"),
                ("SLURM_ARRAY_TASK_COUNT", "3"),
            ],
        );
        assert!(e.starts_with("SLURM_ARRAY_TASK_ID: \"x\""), "{e}");
        let e = err(&d, &[("SLURM_ARRAY_TASK_ID", "1")]);
        assert!(e.starts_with("SLURM_ARRAY_TASK_COUNT: not set"), "{e}");
        let e = err(
            &d,
            &[
                ("SLURM_ARRAY_TASK_ID", "1"),
                ("SLURM_ARRAY_TASK_COUNT", "0"),
            ],
        );
        assert!(e.contains("count is 0"), "{e}");
    }

    #[test]
    fn kubernetes_index_needs_a_count() {
        let d = ShardArgs::default();
        let e = err(&d, &[("JOB_COMPLETION_INDEX", "1")]);
        assert!(
            e.starts_with("JOB_COMPLETION_INDEX: 1 is set") && e.contains(COUNT_VAR),
            "{e}"
        );
        let v = [("JOB_COMPLETION_INDEX", "1"), (COUNT_VAR, "3")];
        assert_eq!(res(&d, &v).unwrap(), Some(Shard { index: 1, count: 3 }));
        let c = ShardArgs {
            count: Some(2),
            ..Default::default()
        };
        assert_eq!(
            res(&c, &[("JOB_COMPLETION_INDEX", "1")]).unwrap(),
            Some(Shard { index: 1, count: 2 })
        );
        let e = err(&c, &[("JOB_COMPLETION_INDEX", "2")]);
        assert!(e.contains("not below the count 2"), "{e}");
        let e = err(&d, &[("JOB_COMPLETION_INDEX", "1"), (COUNT_VAR, "three")]);
        assert!(e.starts_with(&format!("{COUNT_VAR}: \"three\"")), "{e}");
    }

    #[test]
    fn ownership_is_round_robin_and_covers_every_leg_once() {
        let shards: Vec<Shard> = (0..3).map(|i| Shard { index: i, count: 3 }).collect();
        for leg in 0..10 {
            assert_eq!(shards.iter().filter(|s| s.owns(leg)).count(), 1);
            assert!(shards[leg % 3].owns(leg));
        }
        let p = Shard { index: 1, count: 3 }.record_path("m");
        assert_eq!(p, Path::new("runs/m.shard-1-of-3.json"));
        assert_eq!(merged_path(&p).unwrap(), Path::new("runs/m.json"));
    }
}
