//! What the launcher says of the job: how many nodes it has, which one this is, and how
//! many of its ranks run here. Every launcher says it in variables of its own; a rank of
//! torchrun under srun sees both, and torchrun's, set for the processes that read, win.
//! Nothing here is asked of the network: a process outside any job sees `None`.

/// The job's shape, as far as the launcher told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Nodes in the job.
    pub nodes: u32,
    /// This node's index, `0..nodes`, when the launcher says it.
    pub node: Option<u32>,
    /// The job's ranks on this node, when the launcher says it.
    pub ranks_here: Option<u32>,
    /// This process's index among them, when the launcher says it.
    pub rank_here: Option<u32>,
    /// The variables it came from, for log lines ("by ...").
    pub from: &'static str,
}

/// The job's shape from this process's environment.
pub fn from_env() -> Option<Topology> {
    detect(|k| std::env::var(k).ok())
}

/// The job's shape from the variables `var` looks up.
pub fn detect(var: impl Fn(&str) -> Option<String>) -> Option<Topology> {
    let num = |k: &str| {
        var(k)
            .and_then(|v| v.trim().parse::<u32>().ok())
            .filter(|&n| n > 0)
    };
    let index = |k: &str| var(k).and_then(|v| v.trim().parse::<u32>().ok());
    // torchrun: WORLD_SIZE ranks, LOCAL_WORLD_SIZE of them on each node, GROUP_RANK the
    // node (torchrun starts the same number on every node).
    if let (Some(world), Some(local)) = (num("WORLD_SIZE"), num("LOCAL_WORLD_SIZE")) {
        return Some(Topology {
            nodes: world.div_ceil(local),
            node: index("GROUP_RANK"),
            ranks_here: Some(local),
            rank_here: index("LOCAL_RANK"),
            from: "torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE",
        });
    }
    // SLURM: the job's nodes, this node's index, and the tasks of the step on each node
    // ("2(x3),1": two on each of the first three nodes, one on the fourth).
    if let Some(nodes) = num("SLURM_JOB_NUM_NODES").or_else(|| num("SLURM_NNODES")) {
        let node = index("SLURM_NODEID");
        let ranks_here = num("SLURM_NTASKS_PER_NODE").or_else(|| {
            let spec = var("SLURM_STEP_TASKS_PER_NODE").or_else(|| var("SLURM_TASKS_PER_NODE"))?;
            tasks_on(&spec, node.unwrap_or(0))
        });
        return Some(Topology {
            nodes,
            node,
            ranks_here,
            rank_here: index("SLURM_LOCALID"),
            from: "SLURM_JOB_NUM_NODES",
        });
    }
    // mpirun: Open MPI's and MPICH's (Hydra's) world and local sizes; the node's index is
    // not said.
    for (world, local, here, from) in [
        (
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "Open MPI's OMPI_COMM_WORLD_SIZE and _LOCAL_SIZE",
        ),
        (
            "PMI_SIZE",
            "MPI_LOCALNRANKS",
            "MPI_LOCALRANKID",
            "MPICH's PMI_SIZE and MPI_LOCALNRANKS",
        ),
    ] {
        if let (Some(world), Some(local)) = (num(world), num(local)) {
            return Some(Topology {
                nodes: world.div_ceil(local),
                node: None,
                ranks_here: Some(local),
                rank_here: index(here),
                from,
            });
        }
    }
    // PBS Pro / Torque and Flux: the node count alone.
    for (k, from) in [
        ("PBS_NUM_NODES", "PBS_NUM_NODES"),
        ("FLUX_JOB_NNODES", "FLUX_JOB_NNODES"),
    ] {
        if let Some(nodes) = num(k) {
            return Some(Topology {
                nodes,
                node: None,
                ranks_here: None,
                rank_here: None,
                from,
            });
        }
    }
    None
}

/// The tasks on node `node` by SLURM's `N(xR),M,...` (N on each of R nodes, then M...).
fn tasks_on(spec: &str, node: u32) -> Option<u32> {
    let mut first = 0u32;
    for part in spec.split(',') {
        let part = part.trim();
        let (n, times) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.strip_suffix(')')?.parse::<u32>().ok()?),
            None => (part, 1),
        };
        let n = n.parse::<u32>().ok()?;
        if node < first.saturating_add(times) {
            return Some(n);
        }
        first = first.saturating_add(times);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> Option<Topology> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn outside_a_job_there_is_none() {
        assert_eq!(with(&[("HOME", "/root")]), None);
        assert_eq!(with(&[("SLURM_JOB_NUM_NODES", "0")]), None);
    }

    #[test]
    fn slurm_says_nodes_node_and_the_tasks_here() {
        let t = with(&[
            ("SLURM_JOB_NUM_NODES", "4"),
            ("SLURM_NODEID", "3"),
            ("SLURM_STEP_TASKS_PER_NODE", "8(x3),2"),
        ])
        .unwrap();
        assert_eq!((t.nodes, t.node, t.ranks_here), (4, Some(3), Some(2)));
        let t = with(&[
            ("SLURM_NNODES", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ])
        .unwrap();
        assert_eq!((t.nodes, t.node, t.ranks_here), (2, Some(1), Some(4)));
        // The batch script: one node known, no step.
        let t = with(&[("SLURM_JOB_NUM_NODES", "64")]).unwrap();
        assert_eq!((t.nodes, t.node, t.ranks_here), (64, None, None));
    }

    #[test]
    fn torchrun_under_srun_wins() {
        let t = with(&[
            ("SLURM_JOB_NUM_NODES", "2"),
            ("SLURM_NTASKS_PER_NODE", "1"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("GROUP_RANK", "1"),
            ("LOCAL_RANK", "0"),
        ])
        .unwrap();
        assert_eq!((t.nodes, t.node, t.ranks_here), (2, Some(1), Some(8)));
        assert_eq!(t.rank_here, Some(0));
        assert!(t.from.starts_with("torchrun"));
    }

    #[test]
    fn mpirun_says_sizes_and_pbs_and_flux_the_node_count() {
        let t = with(&[
            ("OMPI_COMM_WORLD_SIZE", "12"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
        ])
        .unwrap();
        assert_eq!((t.nodes, t.node, t.ranks_here), (3, None, Some(4)));
        assert_eq!(t.rank_here, Some(3));
        let t = with(&[("PMI_SIZE", "8"), ("MPI_LOCALNRANKS", "8")]).unwrap();
        assert_eq!(t.nodes, 1);
        assert_eq!(with(&[("PBS_NUM_NODES", "5")]).unwrap().nodes, 5);
        assert_eq!(with(&[("FLUX_JOB_NNODES", "7")]).unwrap().nodes, 7);
    }

    #[test]
    fn slurm_task_lists_are_read_node_by_node() {
        assert_eq!(tasks_on("2(x3),1", 0), Some(2));
        assert_eq!(tasks_on("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on("2(x3),1", 4), None);
        assert_eq!(tasks_on("4", 0), Some(4));
        assert_eq!(tasks_on("x(", 0), None);
    }
}
