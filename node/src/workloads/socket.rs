//! The agent's Unix socket (`<state>/socket/agent.sock`, messages: `gpuslice_contract::socket`), open to
//! every local user: the agent tells callers apart by the socket's peer credentials. A
//! connection's first request decides what it is: a claim ([`crate::workloads::claims`]), a shim's compute
//! session ([`crate::workloads::compute`]), a dataset file through the local cache ([`crate::protections::cache`]) or
//! root's word that GPUs were reset ([`crate::protections::faults`]). One thread per connection; a timer
//! thread for the arbiters.
//!
//! Every local process can reach the socket, so it holds against hostile callers: a line is at
//! most [`MAX_LINE`] bytes, the first one must come within [`FIRST_LINE_TIMEOUT`], at most
//! [`MAX_CONNECTIONS`] connections are served at once and [`MAX_PER_PEER`] per pod (or per user
//! outside pods); a caller past a limit is refused with the reason, and a thread that cannot be
//! started costs that connection only. Processes in a pod take no slice and reset no GPU here:
//! pods get slices through DRA, GPU resets are the node's root's.

use std::collections::HashMap;
use std::io::{BufReader, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpuslice_contract::StateDir;
use gpuslice_contract::socket::{self, Reply, Request, read_line};

use crate::workloads::claims::Claims;
use crate::workloads::compute::Compute;

/// Why the socket cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("serving the agent's socket {path}: {source}")]
pub struct SocketError {
    path: String,
    source: std::io::Error,
}

/// How long a new connection may take to say what it wants.
pub const FIRST_LINE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at once, all callers together.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections served at once for one pod (or one user outside pods).
pub const MAX_PER_PEER: usize = 256;
/// Each connection's thread: enough for a request, a cache fetch and its small async runtime.
const THREAD_STACK: usize = 256 * 1024;

/// Who a connection counts against: its pod, else its user.
fn peer_key(pod: Option<&str>, uid: u32) -> String {
    pod.map_or_else(|| format!("uid {uid}"), |pod| format!("pod {pod}"))
}

/// Connections being served, in all and per peer.
#[derive(Default)]
struct Admitted {
    total: usize,
    per_peer: HashMap<String, usize>,
}

/// A connection's place among [`Admitted`]; given back when dropped.
struct Ticket {
    admitted: Arc<Mutex<Admitted>>,
    peer: String,
}

impl Ticket {
    fn take(admitted: &Arc<Mutex<Admitted>>, peer: String) -> Result<Ticket, String> {
        let mut a = admitted.lock().unwrap_or_else(|p| p.into_inner());
        if a.total >= MAX_CONNECTIONS {
            return Err(format!(
                "the agent serves {MAX_CONNECTIONS} connections already; try again later"
            ));
        }
        let mine = a.per_peer.entry(peer.clone()).or_default();
        if *mine >= MAX_PER_PEER {
            return Err(format!(
                "{peer} has {MAX_PER_PEER} connections to the agent open already; close some"
            ));
        }
        *mine += 1;
        a.total += 1;
        Ok(Ticket {
            admitted: admitted.clone(),
            peer,
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut a = self.admitted.lock().unwrap_or_else(|p| p.into_inner());
        a.total = a.total.saturating_sub(1);
        if let Some(n) = a.per_peer.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                a.per_peer.remove(&self.peer);
            }
        }
    }
}

/// What the socket serves: the node's claims, its compute arbiters, its dataset caches, and
/// the inbox of fault events (GPU resets go there).
#[derive(Clone, Default)]
pub struct Node {
    pub claims: Arc<Claims>,
    pub compute: Arc<Compute>,
    pub caches: Arc<crate::protections::cache::Caches>,
    pub faults: crate::protections::faults::Inbox,
}

impl Node {
    /// Binds `<state>/socket/agent.sock` (replacing one an earlier agent left) and serves it, and the
    /// arbiters' timer, on background threads until the process ends.
    pub fn serve(&self, state: &StateDir) -> Result<(), SocketError> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = state.socket();
        let failed = |source| SocketError {
            path: path.display().to_string(),
            source,
        };
        let dir = path.parent().unwrap_or(state.root());
        std::fs::create_dir_all(dir).map_err(failed)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).map_err(failed)?;
        // A socket left by an earlier agent would refuse the bind.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(failed)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(failed)?;
        self.compute.start_timer();
        let node = self.clone();
        let state = state.clone();
        let admitted = Arc::new(Mutex::new(Admitted::default()));
        std::thread::Builder::new()
            .name("agent-socket".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    match stream {
                        Ok(stream) => node.admit(stream, &state, &admitted),
                        // Out of file descriptors, say: the pending caller waits a moment
                        // rather than the loop spinning.
                        Err(e) => {
                            tracing::warn!("accepting on the agent's socket: {e}");
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    }
                }
            })
            .map_err(failed)?;
        Ok(())
    }

    /// Serves a new connection on a thread of its own, or refuses it at once when its caller
    /// is past a limit or no thread can be started.
    fn admit(&self, stream: UnixStream, state: &StateDir, admitted: &Arc<Mutex<Admitted>>) {
        let Ok(credentials) = rustix::net::sockopt::socket_peercred(&stream) else {
            return;
        };
        let pid = credentials.pid.as_raw_nonzero().get() as u32;
        // The caller's pod (by its cgroup), read once: it is counted and judged by it.
        let pod = crate::workloads::process::pod_of(pid);
        let ticket =
            match Ticket::take(admitted, peer_key(pod.as_deref(), credentials.uid.as_raw())) {
                Ok(ticket) => ticket,
                Err(reason) => {
                    // The reply fits the socket's buffer: this write does not wait for the caller.
                    let _ = stream.set_nonblocking(true);
                    let _ = (&stream).write_all(&socket::line(&Reply::Refused { reason }));
                    return;
                }
            };
        let node = self.clone();
        let state = state.clone();
        let spawned = std::thread::Builder::new()
            .name("agent-connection".into())
            .stack_size(THREAD_STACK)
            .spawn(move || {
                let _ticket = ticket;
                if let Err(e) = node.connection(stream, credentials, pod, &state) {
                    tracing::debug!("socket connection ended: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("a socket connection was dropped: no thread for it ({e})");
        }
    }

    fn connection(
        &self,
        stream: UnixStream,
        credentials: rustix::net::UCred,
        in_pod: Option<String>,
        state: &StateDir,
    ) -> std::io::Result<()> {
        let client = credentials.pid.as_raw_nonzero().get() as u32;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        stream.set_read_timeout(Some(FIRST_LINE_TIMEOUT))?;
        read_line(&mut reader, &mut line)?;
        // Claims and compute sessions stay open, idle, for as long as their workload runs.
        stream.set_read_timeout(None)?;
        match serde_json::from_str(&line) {
            Ok(Request::Want(_) | Request::GpuReset { .. }) if in_pod.is_some() => {
                (&stream).write_all(&socket::line(&Reply::Refused {
                    reason: format!(
                        "pid {client} runs in pod {}: pods get slices through their ResourceClaims (the policy label or resource), and GPU resets are said by the node's root",
                        in_pod.unwrap_or_default()
                    ),
                }))
            }
            Ok(Request::Want(want)) => self.claims.serve(stream, reader, want, client, state),
            Ok(Request::Compute { slice }) => {
                let claims = self.claims.held();
                self.compute.serve(stream, reader, &slice, client, &claims)
            }
            Ok(Request::Cache { source, pool }) => {
                let caller = crate::protections::cache::Caller {
                    uid: credentials.uid.as_raw(),
                    gid: credentials.gid.as_raw(),
                };
                let reply = match self.caches.fetch(&source, pool.as_deref(), caller) {
                    Ok(f) => Reply::Cached {
                        path: f.path,
                        object: f.object,
                        size: f.size,
                        hit: f.hit,
                    },
                    Err(reason) => Reply::Refused { reason },
                };
                (&stream).write_all(&socket::line(&reply))
            }
            Ok(Request::GpuReset { gpus }) => {
                // Lifting a quarantine puts a GPU back in service: root's call only.
                let reply = if credentials.uid.is_root() {
                    self.faults.reset(gpus.clone());
                    Reply::ResetTaken { gpus }
                } else {
                    Reply::Refused {
                        reason: "only root may say that GPUs were reset (run it with sudo)".into(),
                    }
                };
                (&stream).write_all(&socket::line(&reply))
            }
            _ => (&stream).write_all(&socket::line(&Reply::Refused {
                reason: "the first request must be a `want`, `compute`, `cache` or `gpuReset`"
                    .into(),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead as _, Write as _};
    use std::os::unix::net::UnixStream;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use gpuslice_contract::socket::MAX_LINE;
    use proptest::prelude::*;

    use super::*;

    static PANICS: AtomicUsize = AtomicUsize::new(0);

    /// One agent socket for all cases, with a panic hook that counts panics on any thread.
    fn served() -> &'static StateDir {
        static STATE: std::sync::OnceLock<(tempfile::TempDir, StateDir)> =
            std::sync::OnceLock::new();
        &STATE
            .get_or_init(|| {
                let previous = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| {
                    PANICS.fetch_add(1, Ordering::SeqCst);
                    previous(info);
                }));
                let dir = tempfile::tempdir().unwrap();
                let state = StateDir::new(dir.path());
                Node::default().serve(&state).unwrap();
                (dir, state)
            })
            .1
    }

    /// What the agent answers a whole request (to the end of its first line).
    fn answer(state: &StateDir, bytes: &[u8]) -> String {
        let mut stream = UnixStream::connect(state.socket()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        // A refusal may close the connection before all is written.
        let _ = stream.write_all(bytes);
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut line = String::new();
        let _ = BufReader::new(stream).read_line(&mut line);
        line
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Whatever a caller sends — bytes, JSON of the wrong shape, a request cut anywhere,
        /// lines longer than the limit — the agent answers or hangs up, never panics, and goes
        /// on serving the next caller.
        #[test]
        fn no_bytes_on_the_socket_stop_the_agent(
            junk in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..512),
                "\\PC{0,200}".prop_map(String::into_bytes),
                (0usize..80).prop_map(|cut| br#"{"want":{"policy":"p","noWait":true}}"#
                    .iter().copied().take(cut).collect()),
                (MAX_LINE - 8..MAX_LINE + 64).prop_map(|n| vec![b'{'; n]),
                Just(br#"{"compute":{"slice":"../../etc"}}"#.to_vec()),
                Just(br#"{"cache":{"source":"/proc/self/mem"}}"#.to_vec()),
                Just(br#"{"gpuReset":{"gpus":"all"}}"#.to_vec()),
                Just(br#"{"running":{"pid":1}}"#.to_vec()),
            ],
        ) {
            let state = served();
            answer(state, &junk);
            let after = answer(state, b"{\"cache\":{\"source\":\"/x\"}}\n");
            prop_assert!(after.contains("refused"), "the agent stopped answering: {after:?}");
            prop_assert_eq!(PANICS.load(Ordering::SeqCst), 0);
        }
    }
}
