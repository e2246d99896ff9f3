//! An emulated CUDA MPS control daemon (`nvidia-cuda-mps-control`), driven by the real
//! command-line interface: `-d` starts it in the background, `-f` in the foreground, and without
//! either it reads commands from standard input and sends them to the running daemon
//! (`echo quit | nvidia-cuda-mps-control`). Its pipe directory is `CUDA_MPS_PIPE_DIRECTORY`
//! (default `/tmp/nvidia-mps`), holding the `control` socket and the
//! `nvidia-cuda-mps-control.pid` file, its log `control.log` in `CUDA_MPS_LOG_DIRECTORY`
//! (default `/var/log/nvidia-mps`).
//!
//! Commands, as NVIDIA documents them: `get_server_list`, `get_client_list <pid>`, `quit`,
//! `set_default_active_thread_percentage <n>`, `get_default_active_thread_percentage`,
//! `set_default_device_pinned_mem_limit <device> <limit>`, `get_default_device_pinned_mem_limit
//! <device>`. The emulated CUDA driver connects at `cuInit` (`client <pid>`) and is told the
//! daemon's defaults: a client's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` only lowers the daemon's.
//! The emulation has one server, in the daemon's own process, started for the first client and
//! kept until `quit`: NVML lists it as a compute process holding [`SERVER_CONTEXT`] and no MPS
//! client, and lists each client (whose CUDA context the emulated driver marks) in both lists,
//! as `nvidia-smi` shows `C` for `nvidia-cuda-mps-server` and `M+C` for its clients.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The pipe directory when `CUDA_MPS_PIPE_DIRECTORY` is unset.
pub const DEFAULT_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";
/// The log directory when `CUDA_MPS_LOG_DIRECTORY` is unset.
pub const DEFAULT_LOG_DIRECTORY: &str = "/var/log/nvidia-mps";
/// The control socket, in the pipe directory.
pub const CONTROL: &str = "control";
/// The daemon's pid file, in the pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// What the client tool prints when no daemon answers (NVIDIA's wording).
pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";

/// The pipe directory the environment names.
pub fn pipe_directory() -> PathBuf {
    std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_PIPE_DIRECTORY), PathBuf::from)
}

/// The log directory the environment names.
pub fn log_directory() -> PathBuf {
    std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(DEFAULT_LOG_DIRECTORY), PathBuf::from)
}

/// What the daemon tells a client at `cuInit`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTerms {
    /// The daemon's default active thread percentage (100 unless set).
    pub thread_percentage: u32,
    /// Pinned device memory limit per device ordinal, in bytes.
    pub pinned: BTreeMap<u32, u64>,
}

/// Connects a CUDA client to the daemon of `pipe`: `None` when none answers (the program then
/// runs without MPS, as CUDA does). The returned stream stays open while the client lives.
pub fn connect_client(pipe: &Path, pid: u32) -> Option<(UnixStream, ClientTerms)> {
    let mut stream = UnixStream::connect(pipe.join(CONTROL)).ok()?;
    // A daemon that does not answer is no daemon: CUDA goes on without MPS.
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    writeln!(stream, "client {pid}").ok()?;
    let mut line = String::new();
    BufReader::new(stream.try_clone().ok()?)
        .read_line(&mut line)
        .ok()?;
    let mut words = line.split_whitespace();
    if words.next()? != "ok" {
        return None;
    }
    let thread_percentage = words.next()?.parse().ok()?;
    let pinned = words
        .filter_map(|w| {
            let (device, bytes) = w.split_once('=')?;
            Some((device.parse().ok()?, bytes.parse().ok()?))
        })
        .collect();
    Some((
        stream,
        ClientTerms {
            thread_percentage,
            pinned,
        },
    ))
}

/// Parses a size as MPS takes it: a number with an optional `K`, `M` or `G` (binary units).
pub fn parse_size(text: &str) -> Option<u64> {
    let text = text.trim();
    let (number, unit) = match text.char_indices().last()? {
        (i, c) if c.is_ascii_alphabetic() => (&text[..i], c.to_ascii_uppercase()),
        _ => (text, 'B'),
    };
    let n: u64 = number.parse().ok()?;
    let shift = match unit {
        'B' => 0,
        'K' => 10,
        'M' => 20,
        'G' => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// Parses `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=1G,1=512M`) into limits per device ordinal;
/// entries it cannot read are ignored, as the driver ignores them.
pub fn parse_pinned_limits(text: &str) -> BTreeMap<u32, u64> {
    text.split(',')
        .filter_map(|entry| {
            let (device, size) = entry.split_once('=')?;
            Some((device.trim().parse().ok()?, parse_size(size)?))
        })
        .collect()
}

#[derive(Default)]
struct Daemon {
    thread_percentage: Option<u32>,
    pinned: BTreeMap<u32, u64>,
    clients: BTreeMap<u64, u32>,
    next: u64,
    /// Whether the MPS server runs: started for the first client, it stays until `quit`.
    server: bool,
}

/// What the MPS server's own context holds on its device (a modelled figure; NVIDIA's is of this
/// order).
pub const SERVER_CONTEXT: u64 = 32 << 20;

/// Starts the emulation's MPS server (this process) on the daemon's GPU, the first of
/// `CUDA_VISIBLE_DEVICES` (a UUID or an index; the first GPU without it): its context goes into
/// the CUDA emulator's ledger, so NVML lists this process among the GPU's compute processes (and
/// not among its MPS clients), as the driver lists `nvidia-cuda-mps-server`. Outside an emulated
/// machine there is nothing to hold.
fn start_server() {
    let Some(state) = std::env::var_os(gpuslice_contract::env::EMULATOR_STATE) else {
        return;
    };
    let state = PathBuf::from(state);
    let Ok(machine) = crate::Store::open(&state).and_then(|s| s.snapshot()) else {
        return;
    };
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    let first = visible.split(',').next().unwrap_or("").trim();
    let key = machine.gpus.iter().find_map(|g| {
        if let Some(i) = g
            .instances
            .iter()
            .find(|i| !first.is_empty() && i.uuid == first)
        {
            return Some(crate::device_key(g.index, Some(i.id)));
        }
        let by_index = first.parse::<u32>().ok().or(first.is_empty().then_some(0));
        (g.uuid == first || by_index == Some(g.index)).then(|| crate::device_key(g.index, None))
    });
    let Some(key) = key else { return };
    if let Ok(ledger) = gpuslice_shm::Ledger::open(&crate::cuda_ledger_path(&state))
        && let Ok(row) = ledger.row_for(gpuslice_shm::Process::current(), key)
    {
        // Held for the process's life: the ledger frees it when the process is gone.
        ledger.charge(row, SERVER_CONTEXT);
    }
}

/// Why the daemon cannot start.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("An instance of this daemon is already running")]
    Running,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> MpsError + '_ {
    move |source| MpsError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Binds the control socket of `pipe` (creating the directory), refusing when a daemon already
/// answers there.
pub fn bind(pipe: &Path) -> Result<UnixListener, MpsError> {
    std::fs::create_dir_all(pipe).map_err(io(pipe))?;
    let control = pipe.join(CONTROL);
    if UnixStream::connect(&control).is_ok() {
        return Err(MpsError::Running);
    }
    let _ = std::fs::remove_file(&control);
    let listener = UnixListener::bind(&control).map_err(io(&control))?;
    // Clients of any user connect, as to NVIDIA's daemon.
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o666))
        .map_err(io(&control))?;
    Ok(listener)
}

/// Serves the control socket until `quit`, calling `ready` once its pid file is written; the
/// socket and pid file are gone before `quit` is answered.
pub fn serve(
    listener: UnixListener,
    pipe: &Path,
    log: &Path,
    ready: impl FnOnce(),
) -> Result<(), MpsError> {
    std::fs::create_dir_all(log).map_err(io(log))?;
    let pid_file = pipe.join(PID_FILE);
    std::fs::write(&pid_file, format!("{}\n", std::process::id())).map_err(io(&pid_file))?;
    let logger = Logger(log.join("control.log"));
    logger.line("Startup");
    ready();
    let daemon = Arc::new(Mutex::new(Daemon::default()));
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        if session(stream, &daemon, &logger, pipe) {
            break;
        }
    }
    Ok(())
}

#[derive(Clone)]
struct Logger(PathBuf);

impl Logger {
    fn line(&self, text: &str) {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.0)
        {
            let _ = writeln!(f, "[pid {}] {text}", std::process::id());
        }
    }
}

/// One connection: a client (kept on a thread of its own while it lives) or one command.
/// Returns whether the daemon should quit.
fn session(stream: UnixStream, daemon: &Arc<Mutex<Daemon>>, logger: &Logger, pipe: &Path) -> bool {
    // A connection that says nothing must not hold the daemon up.
    let _ = stream.set_read_timeout(Some(std::time::Duration::from_secs(5)));
    let Ok(reader) = stream.try_clone() else {
        return false;
    };
    let mut reader = BufReader::new(reader);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return false;
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut out = stream;
    // Any user's CUDA program is a client; only the daemon's user (or root) commands it.
    if words.first() != Some(&"client") && !may_command(&out) {
        logger.line(&format!("Refused from another user: {}", line.trim()));
        let _ = writeln!(out, "{REFUSED}");
        return false;
    }
    let lock = || daemon.lock().unwrap_or_else(|p| p.into_inner());
    match words.as_slice() {
        ["client", pid] => {
            let pid: u32 = pid.parse().unwrap_or(0);
            let (id, reply) = {
                let mut d = lock();
                if !d.server {
                    start_server();
                    d.server = true;
                    logger.line(&format!("Starting new server {}", std::process::id()));
                }
                d.next += 1;
                let id = d.next;
                d.clients.insert(id, pid);
                let pinned: String = d
                    .pinned
                    .iter()
                    .map(|(dev, bytes)| format!(" {dev}={bytes}"))
                    .collect();
                (
                    id,
                    format!("ok {}{pinned}", d.thread_percentage.unwrap_or(100)),
                )
            };
            logger.line(&format!("New client {pid} connected"));
            let _ = writeln!(out, "{reply}");
            let daemon = Arc::clone(daemon);
            let logger = logger.clone();
            // The client holds the connection while it lives; its end is its exit.
            std::thread::spawn(move || {
                let _ = reader.get_ref().set_read_timeout(None);
                let mut rest = String::new();
                while reader.read_line(&mut rest).is_ok_and(|n| n > 0) {
                    rest.clear();
                }
                daemon
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clients
                    .remove(&id);
                logger.line(&format!("Client {pid} disconnected"));
            });
            false
        }
        ["quit"] => {
            logger.line("Received quit");
            let _ = std::fs::remove_file(pipe.join(CONTROL));
            let _ = std::fs::remove_file(pipe.join(PID_FILE));
            logger.line("Shutdown");
            true
        }
        ["get_server_list"] => {
            let d = lock();
            if d.server {
                let _ = writeln!(out, "{}", std::process::id());
            }
            false
        }
        ["get_client_list", _server] => {
            let pids: Vec<u32> = lock().clients.values().copied().collect();
            for pid in pids {
                let _ = writeln!(out, "{pid}");
            }
            false
        }
        ["set_default_active_thread_percentage", n] => {
            match n.parse::<f64>() {
                Ok(p) if p > 0.0 && p <= 100.0 => {
                    lock().thread_percentage = Some(p.ceil() as u32);
                    let _ = writeln!(out, "{}", p.ceil() as u32);
                }
                _ => {
                    let _ = writeln!(out, "Invalid percentage {n}");
                }
            }
            false
        }
        ["get_default_active_thread_percentage"] => {
            let p = lock().thread_percentage.unwrap_or(100);
            let _ = writeln!(out, "{p}.0");
            false
        }
        ["set_default_device_pinned_mem_limit", device, limit] => {
            match (device.parse::<u32>(), parse_size(limit)) {
                (Ok(device), Some(bytes)) => {
                    lock().pinned.insert(device, bytes);
                }
                _ => {
                    let _ = writeln!(out, "Invalid device or limit: {device} {limit}");
                }
            }
            false
        }
        ["get_default_device_pinned_mem_limit", device] => {
            let limit = device
                .parse::<u32>()
                .ok()
                .and_then(|d| lock().pinned.get(&d).copied());
            let _ = match limit {
                Some(bytes) => writeln!(out, "{}M", bytes >> 20),
                None => writeln!(out, "0"),
            };
            false
        }
        _ => {
            let _ = writeln!(out, "Unknown command: {}", line.trim());
            false
        }
    }
}

/// The emulated daemon's answer to a command from a user other than its own or root.
pub const REFUSED: &str = "Permission denied: only the daemon's user or root may command it";

/// Whether the peer of `stream` runs as root or as the daemon's user.
fn may_command(stream: &UnixStream) -> bool {
    let mut cred = libc::ucred {
        pid: 0,
        uid: u32::MAX,
        gid: u32::MAX,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a ucred, for this socket's fd.
    let rc = unsafe {
        libc::getsockopt(
            std::os::fd::AsRawFd::as_raw_fd(stream),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    // SAFETY: geteuid takes no arguments and cannot fail.
    rc == 0 && (cred.uid == 0 || cred.uid == unsafe { libc::geteuid() })
}

/// Sends one command to the daemon of `pipe` and returns its reply.
pub fn command(pipe: &Path, line: &str) -> Result<String, String> {
    let mut stream = UnixStream::connect(pipe.join(CONTROL)).map_err(|_| NO_DAEMON.to_string())?;
    writeln!(stream, "{}", line.trim()).map_err(|e| e.to_string())?;
    stream
        .shutdown(std::net::Shutdown::Write)
        .map_err(|e| e.to_string())?;
    let mut reply = String::new();
    std::io::Read::read_to_string(&mut stream, &mut reply).map_err(|e| e.to_string())?;
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_pinned_limits_read_as_mps_writes_them() {
        assert_eq!(parse_size("2G"), Some(2 << 30));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("1T"), None);
        assert_eq!(
            parse_pinned_limits("0=1G, 1=512M,x=3G"),
            BTreeMap::from([(0, 1 << 30), (1, 512 << 20)])
        );
    }

    #[test]
    fn a_client_gets_the_daemons_defaults_and_is_listed_while_it_lives() {
        let dir = tempfile::tempdir().unwrap();
        let pipe = dir.path().join("pipe");
        let log = dir.path().join("log");
        let listener = bind(&pipe).unwrap();
        let (p, l) = (pipe.clone(), log.clone());
        let daemon = std::thread::spawn(move || serve(listener, &p, &l, || {}));
        assert_eq!(
            command(&pipe, "set_default_active_thread_percentage 25").unwrap(),
            "25\n"
        );
        command(&pipe, "set_default_device_pinned_mem_limit 0 2G").unwrap();
        let (client, terms) = connect_client(&pipe, 4242).unwrap();
        assert_eq!(
            terms,
            ClientTerms {
                thread_percentage: 25,
                pinned: BTreeMap::from([(0, 2 << 30)])
            }
        );
        assert_eq!(command(&pipe, "get_client_list 1").unwrap(), "4242\n");
        drop(client);
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(command(&pipe, "get_client_list 1").unwrap(), "");
        assert!(matches!(bind(&pipe), Err(MpsError::Running)));
        command(&pipe, "quit").unwrap();
        daemon.join().unwrap().unwrap();
        assert_eq!(command(&pipe, "quit").unwrap_err(), NO_DAEMON);
        assert!(!pipe.join(PID_FILE).exists());
    }
}
