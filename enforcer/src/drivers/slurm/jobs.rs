//! What Slurm says, as gpuwarden reads it: the jobs of `squeue --json`, the GPUs of
//! `sinfo --json`, and the GPU requests in a job's TRES strings (`gres:gpu:h100:2`) and array
//! index (`0-9%2`). Pure parsing: nothing here runs a command.

use serde::Deserialize;

/// One job of `squeue --json` (Slurm 22.05, data parser v0.0.38), the fields gpuwarden reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Job {
    /// Its job id (an array task's own id).
    pub job_id: u64,
    /// The array's job id, for an array's pending record and its tasks; 0 otherwise.
    #[serde(default)]
    pub array_job_id: u64,
    /// `PENDING`, `RUNNING`, `COMPLETED`, `CANCELLED`, `TIMEOUT`…
    pub job_state: String,
    /// Who submitted it.
    #[serde(default)]
    pub user_name: String,
    /// `--account`.
    #[serde(default)]
    pub account: String,
    /// The partition it runs in.
    #[serde(default)]
    pub partition: String,
    /// `--comment`.
    #[serde(default)]
    pub comment: String,
    /// Set by the submit hook (`gpuwarden:<hold id>`); only administrators can set it.
    #[serde(default)]
    pub admin_comment: String,
    /// `--wckey`.
    #[serde(default)]
    pub wckey: String,
    /// `--job-name`.
    #[serde(default)]
    pub name: String,
    /// GPU requests, as TRES strings.
    #[serde(default)]
    pub tres_per_node: String,
    /// `--gpus`.
    #[serde(default)]
    pub tres_per_job: String,
    /// `--gpus-per-task`.
    #[serde(default)]
    pub tres_per_task: String,
    /// `--gpus-per-socket`.
    #[serde(default)]
    pub tres_per_socket: String,
    /// Nodes it asked for or holds.
    #[serde(default)]
    pub node_count: Option<u64>,
    /// Tasks.
    #[serde(default)]
    pub tasks: Option<u64>,
    /// Minutes; none when unlimited.
    #[serde(default)]
    pub time_limit: Option<u64>,
    /// `ClusterName`.
    #[serde(default)]
    pub cluster: String,
}

/// `squeue --json`'s document.
#[derive(Debug, Deserialize)]
pub struct Queue {
    /// Every job the controller still knows (running, pending, and ended within `MinJobAge`).
    pub jobs: Vec<Job>,
}

/// `sinfo --json`'s document.
#[derive(Debug, Deserialize)]
pub struct Nodes {
    /// The cluster's nodes.
    pub nodes: Vec<Node>,
}

/// One node of `sinfo --json`.
#[derive(Debug, Deserialize)]
pub struct Node {
    /// Its name.
    pub name: String,
    /// Its generic resources, `gpu:h100:8` or `gpu:h100:4(S:0),gpu:a100:4(S:1)`.
    #[serde(default)]
    pub gres: String,
    /// `idle`, `mixed`, `allocated`, `down`, `drained`…
    #[serde(default)]
    pub state: String,
}

/// Where a job is in its life, as gpuwarden acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Queued, held, or waiting on a dependency: it holds no GPU yet.
    Pending,
    /// It holds its GPUs (running, suspended, being configured).
    Running,
    /// Being killed or cleaning up after its end (`COMPLETING`, which Slurm shows for a
    /// cancelled or finished job until its processes are gone): its lease is not ended yet, but
    /// nothing new starts from it.
    Completing,
    /// It ended; how.
    Ended(End),
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// It finished by itself (exit code 0).
    Completed,
    /// Cancelled (by its user, an administrator, or gpuwarden's reclaim).
    Cancelled,
    /// It ran past its time limit.
    Timeout,
    /// It failed: a non-zero exit, a node failure, out of memory, a failed boot, a deadline,
    /// preemption.
    Failed,
}

impl Job {
    /// Its phase; an unknown state counts as running (it may hold GPUs).
    pub fn phase(&self) -> Phase {
        match self.job_state.as_str() {
            "PENDING" | "REQUEUED" | "REQUEUE_HOLD" | "REQUEUE_FED" | "SPECIAL_EXIT"
            | "RESV_DEL_HOLD" => Phase::Pending,
            "COMPLETING" | "STAGE_OUT" => Phase::Completing,
            "COMPLETED" => Phase::Ended(End::Completed),
            "CANCELLED" => Phase::Ended(End::Cancelled),
            "TIMEOUT" => Phase::Ended(End::Timeout),
            "FAILED" | "NODE_FAIL" | "OUT_OF_MEMORY" | "BOOT_FAIL" | "DEADLINE" | "PREEMPTED"
            | "REVOKED" => Phase::Ended(End::Failed),
            _ => Phase::Running,
        }
    }

    /// The id its lease is named after: the array's for an array's tasks, else its own.
    pub fn lease_job_id(&self) -> u64 {
        if self.array_job_id > 0 {
            self.array_job_id
        } else {
            self.job_id
        }
    }

    /// The GPUs it asks for and the GRES type it names, if any (see [`GpuRequest::of`]).
    pub fn gpus(&self) -> GpuRequest {
        let text = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        GpuRequest::of(&TresFields {
            tres_per_node: text(&self.tres_per_node),
            tres_per_job: text(&self.tres_per_job),
            tres_per_task: text(&self.tres_per_task),
            tres_per_socket: text(&self.tres_per_socket),
            min_nodes: self.node_count,
            max_nodes: None,
            num_tasks: self.tasks,
            ntasks_per_node: None,
            sockets_per_node: None,
        })
    }
}

/// A job's GPU requests as Slurm keeps them, from the submit hook or `squeue`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TresFields {
    /// `--gres=gpu:…`, `--gpus-per-node`.
    pub tres_per_node: Option<String>,
    /// `--gpus`.
    pub tres_per_job: Option<String>,
    /// `--gpus-per-task`.
    pub tres_per_task: Option<String>,
    /// `--gpus-per-socket`.
    pub tres_per_socket: Option<String>,
    /// `--nodes` (its minimum).
    pub min_nodes: Option<u64>,
    /// `--nodes=<min>-<max>`: the most nodes the job may get.
    pub max_nodes: Option<u64>,
    /// `--ntasks`.
    pub num_tasks: Option<u64>,
    /// `--ntasks-per-node`.
    pub ntasks_per_node: Option<u64>,
    /// `--sockets-per-node`.
    pub sockets_per_node: Option<u64>,
}

/// What a job asks for, in GPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuRequest {
    /// GPUs in all (one array task's): the most it may hold.
    pub gpus: u64,
    /// The GRES type named (`h100`), if any.
    pub gpu_type: Option<String>,
    /// Why the GPUs cannot be counted or typed before placement, if so (`--gpus-per-socket`
    /// without `--sockets-per-node`; two GPU types in one job).
    pub uncountable: Option<String>,
}

/// The most a count in a TRES string may be; larger ones are read as this much (no cluster has
/// more, and the admission then denies the request for its size).
const MAX_COUNT: u64 = 1 << 20;

impl GpuRequest {
    /// The GPUs a job asks for: the largest of `--gpus`, per node × nodes, per task × tasks
    /// and per socket (× 1: the sockets are not known before placement). Slurm writes a request
    /// as `gres:gpu:2`, `gres:gpu:h100:2`, `gres/gpu=2` or `gres/gpu:h100=2`, several
    /// separated by commas (other GRES, licenses) of which only `gpu` counts.
    pub fn of(tres: &TresFields) -> Self {
        let set = |n: Option<u64>| n.filter(|&n| n > 0).map(|n| n.min(MAX_COUNT));
        // The most nodes it may get: `--nodes=2-8` may run on 8.
        let nodes = set(tres.min_nodes)
            .unwrap_or(1)
            .max(set(tres.max_nodes).unwrap_or(0));
        let tasks = set(tres.num_tasks)
            .unwrap_or(1)
            .max(set(tres.ntasks_per_node).unwrap_or(0).saturating_mul(nodes));
        let sockets = set(tres.sockets_per_node).map(|s| s.saturating_mul(nodes));
        let mut out = GpuRequest::default();
        for (text, times) in [
            (&tres.tres_per_job, Some(1)),
            (&tres.tres_per_node, Some(nodes)),
            (&tres.tres_per_task, Some(tasks)),
            (&tres.tres_per_socket, sockets),
        ] {
            let Some(text) = text else { continue };
            let (count, gpu_type) = gpus_in(text);
            if count == 0 {
                continue;
            }
            let Some(times) = times else {
                out.uncountable = Some(
                    "--gpus-per-socket needs --sockets-per-node, or the GPUs cannot be counted \
                     before placement"
                        .into(),
                );
                continue;
            };
            out.gpus = out.gpus.max(count.saturating_mul(times));
            match (&out.gpu_type, gpu_type) {
                (None, t) => out.gpu_type = t,
                (Some(a), Some(b)) if *a != b => {
                    out.uncountable = Some(format!("one GPU type per job ({a} and {b} asked)"))
                }
                _ => {}
            }
        }
        if let Some(t) = out.gpu_type.as_deref().filter(|t| t.contains('+')) {
            out.uncountable = Some(format!(
                "one GPU type per job ({} asked)",
                t.replace('+', " and ")
            ));
        }
        out
    }
}

/// The GPUs and the first GRES type named in one TRES string.
fn gpus_in(text: &str) -> (u64, Option<String>) {
    let mut total: u64 = 0;
    let mut gpu_type = None;
    for item in text.split(',') {
        let item = item.trim();
        // `gres:gpu…`, `gres/gpu…`, or a bare `gpu…`.
        let rest = item
            .strip_prefix("gres:")
            .or_else(|| item.strip_prefix("gres/"))
            .unwrap_or(item);
        let Some(rest) = rest.strip_prefix("gpu") else {
            continue;
        };
        // What follows `gpu`: nothing, `:N`, `=N`, `:TYPE`, `:TYPE:N`, `:TYPE=N`.
        let (spec, count) = match rest.rsplit_once([':', '=']) {
            Some((spec, n)) if n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty() => {
                (spec, n.parse::<u64>().unwrap_or(MAX_COUNT).min(MAX_COUNT))
            }
            _ => (rest, 1),
        };
        let kind = spec.trim_start_matches([':', '=']);
        if !rest.is_empty() && !rest.starts_with([':', '=']) {
            // `gpus…`, `gpufoo`: not the gpu GRES.
            continue;
        }
        if !kind.is_empty() {
            match &gpu_type {
                None => gpu_type = Some(kind.to_owned()),
                // Two types in one string: the caller says one type per job.
                Some(t) if t != kind => gpu_type = Some(format!("{t}+{kind}")),
                Some(_) => {}
            }
        }
        total = total.saturating_add(count);
    }
    (total, gpu_type)
}

/// How many tasks an array index (`0-9`, `1,3,5-7`, `0-15:4`, each with an optional `%N`)
/// names, and how many of them may run at once. `None` when it cannot be read.
pub fn array_tasks(index: &str) -> Option<(u64, u64)> {
    let (ranges, throttle) = match index.split_once('%') {
        Some((r, t)) => (r, Some(t.trim().parse::<u64>().ok()?)),
        None => (index, None),
    };
    let mut count: u64 = 0;
    for part in ranges.split(',') {
        let part = part.trim();
        let (range, step) = match part.split_once(':') {
            Some((r, s)) => (r, s.parse::<u64>().ok().filter(|&s| s > 0)?),
            None => (part, 1),
        };
        let (first, last) = match range.split_once('-') {
            Some((a, b)) => (a.parse::<u64>().ok()?, b.parse::<u64>().ok()?),
            None => {
                let n = range.parse::<u64>().ok()?;
                (n, n)
            }
        };
        if last < first {
            return None;
        }
        count = count.checked_add((last - first) / step + 1)?;
    }
    if count == 0 {
        return None;
    }
    let at_once = throttle.filter(|&t| t > 0).map_or(count, |t| t.min(count));
    Some((count, at_once))
}

/// GPUs per GRES type across the nodes that can run jobs (not down, drained or failing):
/// `(type, count)` in the order first seen; an untyped GPU GRES counts under `""`.
pub fn gpus_of(nodes: &Nodes) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = Vec::new();
    for node in &nodes.nodes {
        let state = node.state.to_ascii_lowercase();
        if ["down", "drain", "fail", "future", "unknown"]
            .iter()
            .any(|s| state.contains(s))
        {
            continue;
        }
        for item in node.gres.split(',') {
            // `gpu:h100:8(S:0-1)` → `gpu:h100:8`
            let item = item.split('(').next().unwrap_or("").trim();
            let mut parts = item.split(':');
            if parts.next() != Some("gpu") {
                continue;
            }
            let rest: Vec<&str> = parts.collect();
            let (kind, count) = match rest.as_slice() {
                [n] => ("", n.parse::<u64>().unwrap_or(0)),
                [kind, n] => (*kind, n.parse::<u64>().unwrap_or(0)),
                _ => continue,
            };
            match out.iter_mut().find(|(k, _)| k == kind) {
                Some((_, c)) => *c += count,
                None => out.push((kind.to_owned(), count)),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tres(node: Option<&str>, job: Option<&str>, task: Option<&str>) -> TresFields {
        TresFields {
            tres_per_node: node.map(str::to_owned),
            tres_per_job: job.map(str::to_owned),
            tres_per_task: task.map(str::to_owned),
            ..TresFields::default()
        }
    }

    #[test]
    fn gpu_requests_in_each_of_slurms_spellings() {
        let typed = |n, t: &str| GpuRequest {
            gpus: n,
            gpu_type: Some(t.into()),
            uncountable: None,
        };
        let untyped = |n| GpuRequest {
            gpus: n,
            gpu_type: None,
            uncountable: None,
        };
        // As the 22.05 hook and squeue show them (measured).
        assert_eq!(
            GpuRequest::of(&tres(Some("gres:gpu:h100:2"), None, None)),
            typed(2, "h100")
        );
        assert_eq!(
            GpuRequest::of(&tres(None, Some("gres:gpu:3"), None)),
            untyped(3)
        );
        assert_eq!(
            GpuRequest::of(&tres(Some("gres:gpu:1"), None, None)),
            untyped(1)
        );
        assert_eq!(
            GpuRequest::of(&tres(Some("gres/gpu:a100=4"), None, None)),
            typed(4, "a100")
        );
        assert_eq!(
            GpuRequest::of(&tres(Some("gres/gpu=2"), None, None)),
            untyped(2)
        );
        assert_eq!(
            GpuRequest::of(&tres(Some("gres:gpu"), None, None)),
            untyped(1)
        );
        // Other GRES and licenses do not count; neither does a name that only starts with gpu.
        assert_eq!(
            GpuRequest::of(&tres(
                Some("gres:mps:100,gres:gpu:h100:2,license/matlab=1"),
                None,
                None
            )),
            typed(2, "h100")
        );
        assert_eq!(
            GpuRequest::of(&tres(Some("gres:gpufoo:3"), None, None)),
            untyped(0)
        );
        assert_eq!(GpuRequest::of(&tres(None, None, None)), untyped(0));
        // Per task times tasks, per node times nodes; the largest request wins.
        let mut t = tres(None, None, Some("gres:gpu:1"));
        t.num_tasks = Some(2);
        assert_eq!(GpuRequest::of(&t), untyped(2));
        let mut t = tres(Some("gres:gpu:h100:4"), Some("gres:gpu:2"), None);
        t.min_nodes = Some(2);
        assert_eq!(GpuRequest::of(&t), typed(8, "h100"));
        // The most nodes a range may get; tasks per node times nodes; sockets.
        let mut t = tres(Some("gres:gpu:8"), None, None);
        t.min_nodes = Some(1);
        t.max_nodes = Some(8);
        assert_eq!(GpuRequest::of(&t).gpus, 64);
        let mut t = tres(None, None, Some("gres:gpu:1"));
        t.ntasks_per_node = Some(4);
        t.min_nodes = Some(2);
        assert_eq!(GpuRequest::of(&t).gpus, 8);
        let mut t = TresFields {
            tres_per_socket: Some("gres:gpu:2".into()),
            ..TresFields::default()
        };
        assert!(GpuRequest::of(&t).uncountable.is_some());
        t.sockets_per_node = Some(2);
        assert_eq!(GpuRequest::of(&t).gpus, 4);
        // Two types in one job cannot be priced or checked as one model.
        for (node, job) in [
            (Some("gres:gpu:a10:1,gres:gpu:h100:4"), None),
            (Some("gres:gpu:a10:1"), Some("gres:gpu:h100:4")),
        ] {
            assert!(GpuRequest::of(&tres(node, job, None)).uncountable.is_some());
        }
        // Absurd counts are capped, never overflow.
        assert_eq!(
            GpuRequest::of(&tres(Some("gres:gpu:99999999999999999999999"), None, None)).gpus,
            MAX_COUNT
        );
    }

    #[test]
    fn array_indexes_count_tasks_and_their_throttle() {
        assert_eq!(array_tasks("0-9"), Some((10, 10)));
        assert_eq!(array_tasks("0-9%2"), Some((10, 2)));
        assert_eq!(array_tasks("1,3,5-7"), Some((5, 5)));
        assert_eq!(array_tasks("0-15:4"), Some((4, 4)));
        assert_eq!(array_tasks("7"), Some((1, 1)));
        assert_eq!(array_tasks("0-3%10"), Some((4, 4)));
        assert_eq!(array_tasks("9-0"), None);
        assert_eq!(array_tasks("a-b"), None);
        assert_eq!(array_tasks("0-9%x"), None);
        assert_eq!(array_tasks(""), None);
    }

    #[test]
    fn job_states_map_to_phases_and_arrays_to_one_lease() {
        let job = |state: &str, id, array| Job {
            job_id: id,
            array_job_id: array,
            job_state: state.into(),
            ..serde_json::from_str(r#"{"job_id": 1, "job_state": "PENDING"}"#).unwrap()
        };
        assert_eq!(job("PENDING", 1, 0).phase(), Phase::Pending);
        assert_eq!(job("RUNNING", 1, 0).phase(), Phase::Running);
        assert_eq!(job("SUSPENDED", 1, 0).phase(), Phase::Running);
        assert_eq!(job("COMPLETING", 1, 0).phase(), Phase::Completing);
        assert_eq!(job("TIMEOUT", 1, 0).phase(), Phase::Ended(End::Timeout));
        assert_eq!(job("NODE_FAIL", 1, 0).phase(), Phase::Ended(End::Failed));
        assert_eq!(job("CANCELLED", 1, 0).phase(), Phase::Ended(End::Cancelled));
        assert_eq!(job("RUNNING", 6, 2).lease_job_id(), 2);
        assert_eq!(job("RUNNING", 6, 0).lease_job_id(), 6);
    }

    #[test]
    fn squeue_and_sinfo_documents_are_read() {
        // Trimmed from Slurm 22.05.8's output on a single-node cluster.
        let queue: Queue = serde_json::from_str(
            r#"{"meta": {}, "errors": [], "jobs": [{"job_id": 6, "array_job_id": 2,
            "array_task_id": 0, "job_state": "RUNNING", "user_name": "alice", "account": "",
            "partition": "gpu", "comment": "", "admin_comment": "gpuwarden:hold-1",
            "wckey": "", "name": "wrap", "tres_per_node": "", "tres_per_job": "gres:gpu:3",
            "tres_per_task": "", "tres_per_socket": "", "node_count": 1, "tasks": 1,
            "time_limit": null, "cluster": "study", "gres_detail": ["gpu:h100:3(IDX:0-2)"]}]}"#,
        )
        .unwrap();
        let job = &queue.jobs[0];
        assert_eq!(job.gpus().gpus, 3);
        assert_eq!(job.time_limit, None);
        let nodes: Nodes = serde_json::from_str(
            r#"{"nodes": [{"name": "n1", "gres": "gpu:h100:8", "state": "idle"},
            {"name": "n2", "gres": "gpu:h100:4(S:0),gpu:a100:4(S:1)", "state": "mixed"},
            {"name": "n3", "gres": "gpu:h100:8", "state": "down"},
            {"name": "n4", "gres": "gpu:2", "state": "allocated"},
            {"name": "n5", "gres": "", "state": "idle"}]}"#,
        )
        .unwrap();
        assert_eq!(
            gpus_of(&nodes),
            vec![("h100".into(), 12), ("a100".into(), 4), ("".into(), 2)]
        );
    }
}
