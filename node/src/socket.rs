//! The agent's Unix socket (`<state>/agent.sock`, messages: `gpuslice_contract::socket`), open to
//! every local user: the agent tells callers apart by the socket's peer credentials. A
//! connection's first request decides what it is: a claim ([`crate::claims`]), a shim's compute
//! session ([`crate::compute`]), a dataset file through the local cache ([`crate::cache`]) or
//! root's word that GPUs were reset ([`crate::faults`]). One thread per connection; a timer
//! thread for the arbiters.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use gpuslice_contract::StateDir;
use gpuslice_contract::socket::{self, Reply, Request};

use crate::claims::Claims;
use crate::compute::Compute;

/// Why the socket cannot be served.
#[derive(Debug, thiserror::Error)]
#[error("serving the agent's socket {path}: {source}")]
pub struct SocketError {
    path: String,
    source: std::io::Error,
}

/// What the socket serves: the node's claims, its compute arbiters, its dataset caches, and
/// the inbox of fault events (GPU resets go there).
#[derive(Clone, Default)]
pub struct Node {
    pub claims: Arc<Claims>,
    pub compute: Arc<Compute>,
    pub caches: Arc<crate::cache::Caches>,
    pub faults: crate::faults::Inbox,
}

impl Node {
    /// Binds `<state>/agent.sock` (replacing one an earlier agent left) and serves it, and the
    /// arbiters' timer, on background threads until the process ends.
    pub fn serve(&self, state: &StateDir) -> Result<(), SocketError> {
        use std::os::unix::fs::PermissionsExt as _;
        let path = state.socket();
        let failed = |source| SocketError {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(state.root()).map_err(failed)?;
        // A socket left by an earlier agent would refuse the bind.
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).map_err(failed)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).map_err(failed)?;
        self.compute.start_timer();
        let node = self.clone();
        let state = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let node = node.clone();
                let state = state.clone();
                std::thread::spawn(move || {
                    if let Err(e) = node.connection(stream, &state) {
                        tracing::debug!("socket connection ended: {e}");
                    }
                });
            }
        });
        Ok(())
    }

    fn connection(&self, stream: UnixStream, state: &StateDir) -> std::io::Result<()> {
        let credentials = rustix::net::sockopt::socket_peercred(&stream).ok();
        let client = credentials
            .as_ref()
            .map_or(0, |c| c.pid.as_raw_nonzero().get() as u32);
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        reader.read_line(&mut line)?;
        match serde_json::from_str(&line) {
            Ok(Request::Want(want)) => self.claims.serve(stream, reader, want, client, state),
            Ok(Request::Compute { slice }) => {
                let claims = self.claims.held();
                self.compute.serve(stream, reader, &slice, client, &claims)
            }
            Ok(Request::Cache { source, pool }) => {
                let reply = match self.caches.fetch(&source, pool.as_deref()) {
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
                let reply = if credentials.is_some_and(|c| c.uid.is_root()) {
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
