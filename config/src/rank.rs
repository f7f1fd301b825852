//! Which rank this process is, from the variables of whatever started it: psnet's own,
//! torchrun's, an MPI's, Slurm's or a batch system's array task. The launcher
//! (`psnet-launch --role-from-env`) and the collectives read them here, so both know the same
//! launchers, in the same order, with the same errors.

use crate::env::{self, EnvVar};

/// What started this process, as its rank variables tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Starter {
    /// psnet's own `PSNET_RANK` / `PSNET_WORLD_SIZE`.
    Psnet,
    /// torchrun's `RANK` / `WORLD_SIZE`.
    Torchrun,
    /// Open MPI's `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
    /// MPICH's and Intel MPI's `PMI_RANK` / `PMI_SIZE`.
    Pmi,
    /// Slurm's `SLURM_PROCID` / `SLURM_NTASKS`.
    Slurm,
    /// Grid Engine's array task, `SGE_TASK_ID` (no size).
    GridEngine,
    /// PBS Pro's array index, `PBS_ARRAY_INDEX` (no size).
    PbsPro,
    /// Torque's array id, `PBS_ARRAYID` (no size).
    Torque,
}

/// One starter's rank variable and, where it has one, its size variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankVars {
    /// Who sets them.
    pub starter: Starter,
    /// This process's rank.
    pub rank: EnvVar,
    /// The number of processes; an array task has none.
    pub size: Option<EnvVar>,
}

/// Every starter psnet knows, in the order they are looked at: an explicit choice first, then
/// the launchers.
pub const RANK_VARS: [RankVars; 8] = [
    RankVars {
        starter: Starter::Psnet,
        rank: env::PSNET_RANK,
        size: Some(env::PSNET_WORLD_SIZE),
    },
    RankVars {
        starter: Starter::Torchrun,
        rank: env::RANK,
        size: Some(env::WORLD_SIZE),
    },
    RankVars {
        starter: Starter::OpenMpi,
        rank: env::OMPI_COMM_WORLD_RANK,
        size: Some(env::OMPI_COMM_WORLD_SIZE),
    },
    RankVars {
        starter: Starter::Pmi,
        rank: env::PMI_RANK,
        size: Some(env::PMI_SIZE),
    },
    RankVars {
        starter: Starter::Slurm,
        rank: env::SLURM_PROCID,
        size: Some(env::SLURM_NTASKS),
    },
    RankVars {
        starter: Starter::GridEngine,
        rank: env::SGE_TASK_ID,
        size: None,
    },
    RankVars {
        starter: Starter::PbsPro,
        rank: env::PBS_ARRAY_INDEX,
        size: None,
    },
    RankVars {
        starter: Starter::Torque,
        rank: env::PBS_ARRAYID,
        size: None,
    },
];

/// The starters whose rank `psnet-launch --role-from-env` takes, in order: the MPIs, Slurm
/// and the batch systems' array tasks (psnet's own and torchrun's name collectives ranks, not
/// a kv job's roles). An array task's id is its rank directly: tasks count from 1, and the
/// scheduler, rank 0, runs with the launcher.
pub const ROLE_FROM_ENV: [Starter; 6] = [
    Starter::OpenMpi,
    Starter::Pmi,
    Starter::Slurm,
    Starter::GridEngine,
    Starter::PbsPro,
    Starter::Torque,
];

/// The starters whose variables give a collectives rank, in order: psnet's own names, then
/// torchrun's, the MPIs' and Slurm's (an array task has no size).
pub const COLLECTIVES: [Starter; 5] = [
    Starter::Psnet,
    Starter::Torchrun,
    Starter::OpenMpi,
    Starter::Pmi,
    Starter::Slurm,
];

/// A rank that one starter's variables give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoundRank {
    /// This process's rank.
    pub rank: u32,
    /// The number of processes, where the starter says.
    pub size: Option<u32>,
    /// The variables that said so.
    pub vars: RankVars,
}

impl FoundRank {
    /// The variables' names for messages: `"RANK/WORLD_SIZE"`, or `"SGE_TASK_ID"`.
    pub fn source(&self) -> String {
        match self.vars.size {
            Some(size) => format!("{}/{}", self.vars.rank.name, size.name),
            None => self.vars.rank.name.to_string(),
        }
    }
}

/// Rank variables that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RankError {
    /// A rank or size variable holds something other than a whole number below 2^32.
    #[error("{var}={raw:?} is not a whole number below 2^32: {reason}")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// Its value.
        raw: String,
        /// Why it does not parse.
        reason: String,
    },
    /// Half of a starter's pair is set.
    #[error("{set} is set but {unset} is not")]
    HalfSet {
        /// The variable that is set.
        set: &'static str,
        /// Its partner, which is not.
        unset: &'static str,
    },
}

fn number(
    get: &impl Fn(&EnvVar) -> Option<String>,
    var: &EnvVar,
) -> Result<Option<u32>, RankError> {
    get(var)
        .map(|raw| {
            raw.trim()
                .parse::<u32>()
                .map_err(|e| RankError::NotANumber {
                    var: var.name,
                    reason: e.to_string(),
                    raw,
                })
        })
        .transpose()
}

fn among(starters: &[Starter]) -> impl Iterator<Item = &'static RankVars> + '_ {
    RANK_VARS.iter().filter(|v| starters.contains(&v.starter))
}

/// The first of `starters` (in [`RANK_VARS`]'s order) whose rank variable `get` finds, with its
/// size if that is set too, as a process started by `mpirun` or an array job takes its role.
pub fn first_rank(
    get: impl Fn(&EnvVar) -> Option<String>,
    starters: &[Starter],
) -> Result<Option<FoundRank>, RankError> {
    for vars in among(starters) {
        if let Some(rank) = number(&get, &vars.rank)? {
            let size = match vars.size {
                Some(size) => number(&get, &size)?,
                None => None,
            };
            return Ok(Some(FoundRank {
                rank,
                size,
                vars: *vars,
            }));
        }
    }
    Ok(None)
}

/// Every one of `starters` whose variables `get` finds, each with rank and size, in
/// [`RANK_VARS`]'s order, for a caller that needs the size and checks that they agree. Half a
/// pair set is an error; starters without a size variable are never found here.
pub fn ranks_with_size(
    get: impl Fn(&EnvVar) -> Option<String>,
    starters: &[Starter],
) -> Result<Vec<FoundRank>, RankError> {
    let mut found = Vec::new();
    for vars in among(starters) {
        let Some(size_var) = vars.size else { continue };
        match (number(&get, &vars.rank)?, number(&get, &size_var)?) {
            (Some(rank), Some(size)) => found.push(FoundRank {
                rank,
                size: Some(size),
                vars: *vars,
            }),
            (None, None) => {}
            (Some(_), None) => {
                return Err(RankError::HalfSet {
                    set: vars.rank.name,
                    unset: size_var.name,
                })
            }
            (None, Some(_)) => {
                return Err(RankError::HalfSet {
                    set: size_var.name,
                    unset: vars.rank.name,
                })
            }
        }
    }
    Ok(found)
}

/// The rank variables' names of `starters`, in order, for a message that none is set.
pub fn names(starters: &[Starter]) -> Vec<&'static str> {
    among(starters).map(|v| v.rank.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&EnvVar) -> Option<String> + 'a {
        move |v: &EnvVar| {
            vars.iter()
                .find(|(n, _)| *n == v.name)
                .map(|(_, x)| x.to_string())
        }
    }

    const LAUNCHERS: [Starter; 6] = ROLE_FROM_ENV;

    #[test]
    fn the_first_starter_set_wins_and_an_array_task_has_no_size() {
        let found = first_rank(
            table(&[("SLURM_PROCID", "3"), ("PMI_RANK", "2"), ("PMI_SIZE", "9")]),
            &LAUNCHERS,
        )
        .unwrap()
        .unwrap();
        assert_eq!((found.rank, found.size), (2, Some(9)));
        assert_eq!(found.source(), "PMI_RANK/PMI_SIZE");
        let task = first_rank(table(&[("SGE_TASK_ID", "4")]), &LAUNCHERS)
            .unwrap()
            .unwrap();
        assert_eq!(
            (task.rank, task.size, task.source().as_str()),
            (4, None, "SGE_TASK_ID")
        );
        // A starter the caller did not ask for is not looked at.
        assert_eq!(
            first_rank(table(&[("RANK", "1")]), &LAUNCHERS).unwrap(),
            None
        );
    }

    #[test]
    fn bad_values_and_half_pairs_name_the_variable() {
        assert_eq!(
            first_rank(table(&[("OMPI_COMM_WORLD_RANK", "x")]), &LAUNCHERS).unwrap_err(),
            RankError::NotANumber {
                var: "OMPI_COMM_WORLD_RANK",
                raw: "x".into(),
                reason: "invalid digit found in string".into(),
            }
        );
        let all = [Starter::Psnet, Starter::Torchrun, Starter::Slurm];
        assert_eq!(
            ranks_with_size(table(&[("WORLD_SIZE", "2")]), &all)
                .unwrap_err()
                .to_string(),
            "WORLD_SIZE is set but RANK is not"
        );
        let found = ranks_with_size(
            table(&[
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "2"),
                ("PSNET_RANK", "0"),
                ("PSNET_WORLD_SIZE", "2"),
                ("SGE_TASK_ID", "5"),
            ]),
            &[Starter::Slurm, Starter::Psnet, Starter::GridEngine],
        )
        .unwrap();
        let sources: Vec<String> = found.iter().map(FoundRank::source).collect();
        assert_eq!(
            sources,
            ["PSNET_RANK/PSNET_WORLD_SIZE", "SLURM_PROCID/SLURM_NTASKS"]
        );
        assert_eq!(
            names(&LAUNCHERS),
            [
                "OMPI_COMM_WORLD_RANK",
                "PMI_RANK",
                "SLURM_PROCID",
                "SGE_TASK_ID",
                "PBS_ARRAY_INDEX",
                "PBS_ARRAYID"
            ]
        );
    }
}
