//! The agent's Unix socket (`<state>/socket/agent.sock`), JSON lines. A connection starts with one
//! [`Request`]:
//!
//! - **Claims** (`gpuslice run`): [`Request::Want`]; the agent answers [`Reply::Queued`] (again
//!   whenever the place in line moves), then [`Reply::Granted`] or [`Reply::Refused`]. The claim
//!   lasts as long as the connection; the client sends [`Request::Running`] once its workload runs.
//!   A client whose connection is lost while its workload runs (the agent restarted) connects
//!   again and wants the same slice ([`Want::slice`]), then says `Running` again.
//! - **Compute** (the shim): [`Request::Compute`]; the agent answers [`Ready`] or
//!   [`Reply::Refused`], then both sides exchange [`Compute`] messages.
//!
//! Callers are told apart by the socket's peer credentials, never by what they say.

use std::io::{BufRead, Read as _};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// What a claim asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Want {
    /// A `GpuSlicePolicy`: its memory (plus the pool's headroom) and compute limit and guarantee.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_percent: Option<u32>,
    /// Refuse at once instead of waiting in line.
    #[serde(default)]
    pub no_wait: bool,
    /// Only this slice: a `gpuslice run` whose agent restarted under its running workload
    /// claims the slice the workload runs on again (granted only while nobody else holds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<String>,
}

/// The first line of a connection (and, for a claim, what follows it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Request {
    Want(Want),
    /// The claim's workload started with this pid (a child of the client).
    Running {
        pid: u32,
    },
    /// A process under the shim asks for compute arbitration on its slice.
    Compute {
        slice: String,
    },
    /// A dataset file through the node's local cache: `source` is an absolute path or an
    /// `http://` URL; `pool` names whose cache when the node has several.
    Cache {
        source: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pool: Option<String>,
    },
    /// Root says these GPUs were reset (`1`, `0,3` or `all`): the agent lifts their XID
    /// quarantines at its next pass.
    GpuReset {
        gpus: String,
    },
}

/// The agent's answer to a claim (and its refusal of a compute session).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Reply {
    /// Waiting: 1 is next in line.
    Queued {
        position: usize,
    },
    Granted {
        slice: String,
        config: PathBuf,
        device_uuid: String,
        /// The CheckpointPolicy that drains the workload (its policy's, else its GPU's pool's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        checkpoint: Option<Checkpointing>,
        /// On an MPS slice, the share of the SMs the workload is given (%): its policy's
        /// compute limit where lower than the slice's.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mps_share: Option<u32>,
    },
    Refused {
        reason: String,
    },
    /// The local, read-only file with the source's bytes: `path` on the node; `object` its name
    /// under `objects/` of the cache (in a pod: `/run/gpuslice/cache/objects/<object>`).
    Cached {
        path: PathBuf,
        object: String,
        size: u64,
        hit: bool,
    },
    /// A GPU reset was taken; the agent's next pass lifts the quarantines.
    ResetTaken {
        gpus: String,
    },
}

/// What a workload is told of the CheckpointPolicy that drains it (its marker goes to
/// `<state>/slices/<slice>/checkpoint-done`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpointing {
    /// The signal that asks it to checkpoint now (`SIGUSR1`, …).
    pub signal: String,
    /// Seconds between the checkpoints it should take (the policy's `interval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_seconds: Option<u64>,
}

impl Checkpointing {
    /// The environment that tells a workload: its marker's path (`marker`, as the workload sees
    /// it), the signal, the interval when there is one.
    pub fn env(&self, marker: &std::path::Path) -> Vec<(&'static str, String)> {
        use crate::env;
        let mut out = vec![
            (env::CHECKPOINT_DONE, marker.display().to_string()),
            (env::CHECKPOINT_SIGNAL, self.signal.clone()),
        ];
        if let Some(seconds) = self.interval_seconds {
            out.push((env::CHECKPOINT_INTERVAL, seconds.to_string()));
        }
        out
    }
}

/// The agent's answer to [`Request::Compute`] when it takes the process on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ready {
    pub time_slice_us: u64,
}

/// The compute conversation after [`Ready`] (design: `docs/compute.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Compute {
    /// Shim: the process wants the GPU.
    Acquire,
    /// Shim: the process's queued work has finished; the GPU is free.
    Release,
    /// Shim, after a yield: it launches nothing more; only its queued work remains.
    Stopped,
    /// Agent: the GPU is the process's.
    Grant,
    /// Agent: a grant to an uncapped slice nobody else wants; launches need no accounting until
    /// `contended` (or `yield`).
    Free,
    /// Agent: stop launching and release.
    Yield,
    /// Agent, to the holder: another process waits, so an idle holder should hand the GPU on.
    Contended,
}

impl Compute {
    const ALL: [Compute; 7] = [
        Compute::Acquire,
        Compute::Release,
        Compute::Stopped,
        Compute::Grant,
        Compute::Free,
        Compute::Yield,
        Compute::Contended,
    ];

    /// The message as one line on the socket, newline included: what [`line`] writes (tested),
    /// kept as constants so that the shim sends and matches without allocating, in one write.
    pub const fn wire(self) -> &'static str {
        match self {
            Compute::Acquire => "\"acquire\"\n",
            Compute::Release => "\"release\"\n",
            Compute::Stopped => "\"stopped\"\n",
            Compute::Grant => "\"grant\"\n",
            Compute::Free => "\"free\"\n",
            Compute::Yield => "\"yield\"\n",
            Compute::Contended => "\"contended\"\n",
        }
    }

    /// The message a line carries, if it is one.
    pub fn from_wire(line: &str) -> Option<Compute> {
        let line = line.trim();
        Compute::ALL
            .into_iter()
            .find(|m| m.wire().trim_end() == line)
    }
}

/// One message as a line on the socket.
pub fn line(message: &impl Serialize) -> Vec<u8> {
    // Serialising these plain types cannot fail.
    let mut out = serde_json::to_vec(message).unwrap_or_default();
    out.push(b'\n');
    out
}

/// The longest request line (the longest real one is a few hundred bytes).
pub const MAX_LINE: usize = 64 * 1024;

/// Reads one line of at most [`MAX_LINE`] bytes (0 at the end of the stream); a longer one is an
/// error, so a caller cannot make the agent buffer without bound.
pub fn read_line(reader: &mut impl BufRead, line: &mut String) -> std::io::Result<usize> {
    let limit = (MAX_LINE + 1) as u64;
    let n = reader.by_ref().take(limit).read_line(line)?;
    if n > MAX_LINE || (n == MAX_LINE && !line.ends_with('\n')) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a request line is longer than {MAX_LINE} bytes"),
        ));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_messages_travel_as_serde_writes_them() {
        for m in Compute::ALL {
            assert_eq!(line(&m), m.wire().as_bytes());
            assert_eq!(Compute::from_wire(m.wire()), Some(m));
            assert_eq!(Compute::from_wire(m.wire().trim_end()), Some(m));
        }
        assert_eq!(Compute::from_wire("\"nonsense\""), None);
    }

    #[test]
    fn requests_read_back() {
        let hello = Request::Compute {
            slice: "gpu0-s1".into(),
        };
        let text = line(&hello);
        assert_eq!(text, b"{\"compute\":{\"slice\":\"gpu0-s1\"}}\n");
        assert_eq!(serde_json::from_slice::<Request>(&text).unwrap(), hello);
        let refused: Reply = serde_json::from_str(r#"{"refused":{"reason":"no"}}"#).unwrap();
        assert_eq!(
            refused,
            Reply::Refused {
                reason: "no".into()
            }
        );
    }
}
