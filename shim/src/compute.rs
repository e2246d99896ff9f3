//! Compute shares, the shim's half (design: `docs/compute.md`). A process on a software slice
//! runs kernels only while the node agent's arbiter has granted its slice the GPU. The launch
//! path costs two atomic operations while the grant lasts; everything else happens on a monitor
//! thread that talks to the agent:
//!
//! - the first launch without a grant asks for one (`"acquire"`) and waits;
//! - on `"grant"` the launches go through;
//! - on `"yield"`, or when the process has had nothing queued for a moment, the monitor stops new
//!   launches, waits for the work already queued to finish (so the time the agent charges is the
//!   GPU time the slice's work took) and gives the GPU back (`"release"`).
//!
//! The agent is the only judge: the process can delay its release, never grant itself time, and
//! a holder that ignores a yield is overruled (see `gpuslice_node::workloads::arbiter`). When the agent
//! cannot be reached at the first launch the shim passes launches through (no agent serves this
//! node), except in a slice's container (the pinned config), where the agent that prepared the
//! slice is only restarting: there launches wait for it; when the agent refuses the process (its slice belongs to another workload), launches
//! fail with `CUDA_ERROR_NOT_PERMITTED`. Once governed, a process stays governed: when the agent
//! goes away (a restart, a crash), launches wait while the monitor reconnects with backoff, and
//! go on under the new agent's grants.

use std::collections::HashSet;
use std::ffi::c_int;
use std::io::{ErrorKind, Read as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use gpuslice_contract::cuda::{CUDA_ERROR_NOT_PERMITTED as NOT_PERMITTED, Handle};
use gpuslice_contract::socket::{self, Compute, Reply, Request};

use crate::limits::{Limits, limits};
use crate::real::{Lib, resolve};

/// The launch gate in one word: launches in flight (bits 0–19), the grant (bit 20), and a
/// launch counter (bits 21–63, wrapping) by which the monitor sees activity.
static GATE: AtomicU64 = AtomicU64::new(0);
const IN_FLIGHT: u64 = (1 << 20) - 1;
const HOLD: u64 = 1 << 20;
const ONE_LAUNCH: u64 = (1 << 21) | 1;

/// Another process waits for the GPU (told by the agent): an idle holder then hands it on.
static CONTENDED: AtomicBool = AtomicBool::new(false);
/// The grant is free (no cap, nobody waiting): launches skip the gate's accounting.
static FREE: AtomicBool = AtomicBool::new(false);
/// How long launches that saw [`FREE`] may still be on their way into the driver.
const FREE_GRACE: Duration = Duration::from_micros(200);
/// Set in a forked child, which has no monitor thread: it is not governed.
static FORKED: AtomicBool = AtomicBool::new(false);
/// Streams being captured into graphs: their launches queue nothing, and no context may be
/// synchronised while a capture is open.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);
static CAPTURING: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// How long the agent may take to answer a new connection before launches go through
/// ungoverned.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Reconnecting to an agent that went away: the first wait, doubled up to the last.
const RECONNECT_FIRST: Duration = Duration::from_millis(50);
const RECONNECT_MOST: Duration = Duration::from_secs(1);
/// How often the monitor looks for idleness while it holds the GPU.
const POLL: Duration = Duration::from_micros(200);
/// After its queued work has finished, a holder keeps the GPU this long for its next launch
/// (a training loop's host-side gap between steps) before giving it up. Shorter hands idle time
/// on sooner, but a busy process whose launching thread is merely descheduled (loaded hosts)
/// would then lose the GPU for a whole turn; 1 ms costs about 1 % in the bursty benchmark.
const IDLE_GRACE: Duration = Duration::from_millis(1);

enum Arbitration {
    /// Not on a software slice, or the agent is unreachable: launches go through.
    Off,
    /// The agent refused this process: launches fail.
    Refused,
    On(Session),
}

struct Session {
    /// The connection requests are written to (replaced when the monitor reconnects; none
    /// until the first connection in a container whose agent was not ready).
    socket: Mutex<Option<UnixStream>>,
    local: Mutex<Local>,
    granted: Condvar,
    /// The agent went away: launches wait until the monitor has reconnected.
    lost: AtomicBool,
}

#[derive(Default)]
struct Local {
    /// An `acquire` is outstanding or granted.
    asked: bool,
    /// Threads waiting for a grant to launch: the slice is not idle while any wait.
    waiting: usize,
    /// Contexts that launched, to wait for their work before releasing.
    contexts: Vec<usize>,
}

static ARBITRATION: OnceLock<Arbitration> = OnceLock::new();

fn arbitration() -> &'static Arbitration {
    ARBITRATION.get_or_init(|| match connect() {
        Ok(Some(session)) => Arbitration::On(session),
        Ok(None) => Arbitration::Off,
        Err(Refusal::Refused(reason)) => {
            eprintln!(
                "gpuslice: the node agent refused compute time: {reason}; kernel launches fail"
            );
            Arbitration::Refused
        }
        Err(Refusal::Unreachable(reason)) => {
            eprintln!("gpuslice: compute share not enforced: {reason}");
            Arbitration::Off
        }
    })
}

enum Refusal {
    Refused(String),
    Unreachable(String),
}

/// Connects to the agent when this process is on a software slice.
fn connect() -> Result<Option<Session>, Refusal> {
    let Limits::Capped(slice) = limits() else {
        return Ok(None);
    };
    let Some(socket_path) = slice.agent_socket.as_deref() else {
        return Ok(None);
    };
    let socket = match handshake(socket_path, &slice.id) {
        Ok(socket) => Some(socket),
        // In a slice's container the agent prepared this slice: it is restarting (or has not
        // taken up the slice again yet), so launches wait for it as after losing it.
        Err(Refusal::Unreachable(reason) | Refusal::Refused(reason)) if slice.pinned => {
            eprintln!(
                "gpuslice: the node agent is not ready ({reason}); kernel launches wait for it"
            );
            None
        }
        Err(refusal) => return Err(refusal),
    };
    let unreachable = |e: std::io::Error| {
        Refusal::Unreachable(format!("the node agent at {}: {e}", socket_path.display()))
    };
    // SAFETY: registering a fork handler that only stores to an atomic.
    unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    let monitor = socket
        .as_ref()
        .map(UnixStream::try_clone)
        .transpose()
        .map_err(unreachable)?;
    let (path, id) = (socket_path.to_path_buf(), slice.id.clone());
    std::thread::Builder::new()
        .name("gpuslice-compute".into())
        .spawn(move || run_monitor(monitor, &path, &id))
        .map_err(unreachable)?;
    Ok(Some(Session {
        lost: AtomicBool::new(socket.is_none()),
        socket: Mutex::new(socket),
        local: Mutex::new(Local::default()),
        granted: Condvar::new(),
    }))
}

/// Opens a compute session for `slice` with the agent at `path`: the connection once the agent
/// said it is ready.
fn handshake(path: &std::path::Path, slice: &str) -> Result<UnixStream, Refusal> {
    let unreachable = |e: std::io::Error| {
        Refusal::Unreachable(format!("the node agent at {}: {e}", path.display()))
    };
    let mut socket = UnixStream::connect(path).map_err(unreachable)?;
    // An agent that accepts but never answers must not hang the program's first launch.
    socket
        .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
        .map_err(unreachable)?;
    let hello = Request::Compute {
        slice: slice.to_string(),
    };
    socket
        .write_all(&socket::line(&hello))
        .map_err(unreachable)?;
    let reply = read_line(&mut socket, &mut Vec::new()).map_err(unreachable)?;
    socket.set_read_timeout(None).map_err(unreachable)?;
    if let Ok(Reply::Refused { reason }) = serde_json::from_str(&reply) {
        return Err(Refusal::Refused(reason));
    }
    serde_json::from_str::<socket::Ready>(&reply)
        .map_err(|e| Refusal::Unreachable(format!("the node agent's answer {reply:?}: {e}")))?;
    Ok(socket)
}

extern "C" fn forked() {
    FORKED.store(true, Ordering::Relaxed);
}

fn session() -> Option<&'static Session> {
    match ARBITRATION.get() {
        Some(Arbitration::On(s)) => Some(s),
        _ => None,
    }
}

/// Reads one line (without its newline), keeping what follows in `buffer`.
fn read_line(socket: &mut UnixStream, buffer: &mut Vec<u8>) -> std::io::Result<String> {
    loop {
        if let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            return Ok(String::from_utf8_lossy(&line[..end]).into_owned());
        }
        let mut chunk = [0u8; 256];
        match socket.read(&mut chunk)? {
            0 => return Err(ErrorKind::UnexpectedEof.into()),
            n => buffer.extend_from_slice(&chunk[..n]),
        }
    }
}

fn send(session: &Session, message: Compute) -> bool {
    session
        .socket
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .is_some_and(|mut s| s.write_all(message.wire().as_bytes()).is_ok())
}

/// Runs a launch on `stream` when the slice holds the GPU, waiting for a grant if needed.
pub fn gate(stream: Handle, launch: impl FnOnce() -> c_int) -> c_int {
    let session = match arbitration() {
        Arbitration::Off => return launch(),
        Arbitration::Refused => return NOT_PERMITTED,
        Arbitration::On(s) => s,
    };
    if FREE.load(Ordering::Relaxed) {
        return launch();
    }
    if FORKED.load(Ordering::Relaxed) || captured(stream) {
        return launch();
    }
    loop {
        let before = GATE.fetch_add(ONE_LAUNCH, Ordering::SeqCst);
        if before & HOLD != 0 {
            let rc = launch();
            GATE.fetch_sub(1, Ordering::SeqCst);
            return rc;
        }
        GATE.fetch_sub(ONE_LAUNCH, Ordering::SeqCst);
        wait_for_grant(session);
    }
}

/// Asks for the GPU (once) and waits for it; while the agent is gone, waits for the monitor to
/// reconnect and asks the new one.
fn wait_for_grant(session: &Session) {
    let mut local = session.local.lock().unwrap_or_else(|p| p.into_inner());
    remember_context(&mut local);
    local.waiting += 1;
    while GATE.load(Ordering::SeqCst) & HOLD == 0 {
        // Asked again after every release (a grant may be taken back before this thread ran)
        // and after a reconnection.
        if !local.asked && !session.lost.load(Ordering::SeqCst) {
            local.asked = true;
            if !send(session, Compute::Acquire) {
                lose(session);
            }
        }
        local = session
            .granted
            .wait_timeout(local, Duration::from_millis(100))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    local.waiting -= 1;
}

/// The agent went away: no grant holds any more, launches wait for the monitor to reconnect.
fn lose(session: &Session) {
    if !session.lost.swap(true, Ordering::SeqCst) {
        eprintln!("gpuslice: lost the node agent; kernel launches wait until it is back");
    }
    FREE.store(false, Ordering::SeqCst);
    CONTENDED.store(false, Ordering::SeqCst);
    GATE.fetch_and(!HOLD, Ordering::SeqCst);
    session.granted.notify_all();
}

/// Connects again (backing off while the agent is away or not ready for this slice yet), then
/// lets waiting launches ask the new agent. Returns the monitor's end of the new connection.
fn reconnect(session: &Session, path: &std::path::Path, slice: &str) -> UnixStream {
    let mut wait = RECONNECT_FIRST;
    loop {
        std::thread::sleep(wait);
        wait = (wait * 2).min(RECONNECT_MOST);
        let Ok(socket) = handshake(path, slice) else {
            continue;
        };
        let Ok(monitor) = socket.try_clone() else {
            continue;
        };
        let mut local = session.local.lock().unwrap_or_else(|p| p.into_inner());
        *session.socket.lock().unwrap_or_else(|p| p.into_inner()) = Some(socket);
        local.asked = false;
        session.lost.store(false, Ordering::SeqCst);
        session.granted.notify_all();
        eprintln!("gpuslice: the node agent is back; kernel launches are governed again");
        return monitor;
    }
}

type CtxGet = unsafe extern "C" fn(*mut Handle) -> c_int;
type CtxSet = unsafe extern "C" fn(Handle) -> c_int;
type CtxSync = unsafe extern "C" fn() -> c_int;

static CTX_GET: AtomicUsize = AtomicUsize::new(0);
static CTX_SET: AtomicUsize = AtomicUsize::new(0);
static CTX_SYNC: AtomicUsize = AtomicUsize::new(0);

fn remember_context(local: &mut Local) {
    let Some(get) = resolve(&CTX_GET, Lib::Cuda, b"cuCtxGetCurrent\0") else {
        return;
    };
    let mut ctx: Handle = std::ptr::null_mut();
    // SAFETY: the driver's cuCtxGetCurrent with a valid out-pointer.
    let get = unsafe { std::mem::transmute::<usize, CtxGet>(get) };
    // SAFETY: as above.
    if unsafe { get(&mut ctx) } == 0 && !ctx.is_null() && !local.contexts.contains(&(ctx as usize))
    {
        local.contexts.push(ctx as usize);
    }
}

/// The program destroyed a context: never touch it again.
pub fn forget_context(ctx: Handle) {
    if let Some(session) = session() {
        let mut local = session.local.lock().unwrap_or_else(|p| p.into_inner());
        local.contexts.retain(|c| *c != ctx as usize);
    }
}

/// Waits for the work this process queued on its contexts to finish.
fn drain(session: &Session) {
    if CAPTURES.load(Ordering::SeqCst) > 0 {
        return; // synchronising now would break the program's capture
    }
    let (Some(set), Some(sync)) = (
        resolve(&CTX_SET, Lib::Cuda, b"cuCtxSetCurrent\0"),
        resolve(&CTX_SYNC, Lib::Cuda, b"cuCtxSynchronize\0"),
    ) else {
        return;
    };
    // SAFETY: the driver's own functions, with their signatures.
    let (set, sync) = unsafe {
        (
            std::mem::transmute::<usize, CtxSet>(set),
            std::mem::transmute::<usize, CtxSync>(sync),
        )
    };
    let contexts = session
        .local
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contexts
        .clone();
    for ctx in contexts {
        // SAFETY: a context the program created and has not destroyed (cuCtxDestroy forgets
        // it), made current on this, the monitor's own, thread.
        unsafe {
            if set(ctx as Handle) == 0 {
                sync();
            }
        }
    }
}

/// Back to counted launches: launches that saw the free grant get a moment to reach the driver.
fn leave_free() {
    if FREE.swap(false, Ordering::SeqCst) {
        std::thread::sleep(FREE_GRACE);
    }
}

/// Stops new launches, waits for those in flight, tells the agent (the next holder may queue
/// its work now: nothing of ours can land behind it), waits for the queued work, and releases
/// the GPU.
fn release(session: &Session) {
    leave_free();
    GATE.fetch_and(!HOLD, Ordering::SeqCst);
    while GATE.load(Ordering::SeqCst) & IN_FLIGHT != 0 {
        std::hint::spin_loop();
    }
    if !send(session, Compute::Stopped) {
        lose(session);
        return;
    }
    drain(session);
    give_back(session);
}

/// Tells the agent, then lets waiting threads ask again (in that order, under the lock their
/// `acquire` is sent under, so the agent never sees an acquire before the release it follows).
fn give_back(session: &Session) {
    let mut local = session.local.lock().unwrap_or_else(|p| p.into_inner());
    if !send(session, Compute::Release) {
        drop(local);
        lose(session);
        return;
    }
    local.asked = false;
    session.granted.notify_all();
}

/// Releases if nothing was launched since `seen` and the queued work is done; keeps holding
/// (returns false) when a launch comes in meanwhile.
fn release_if_idle(session: &Session, seen: u64) -> bool {
    let waiting = || {
        session
            .local
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting
            > 0
    };
    if waiting() {
        return false;
    }
    drain(session);
    let started = Instant::now();
    while started.elapsed() < IDLE_GRACE {
        std::thread::sleep(POLL / 4);
        if GATE.load(Ordering::SeqCst) >> 21 != seen {
            return false;
        }
    }
    // Only if still nothing in flight and no launch since: take the grant back atomically.
    let current = GATE.load(Ordering::SeqCst);
    if current >> 21 != seen
        || current & IN_FLIGHT != 0
        || GATE
            .compare_exchange(current, current & !HOLD, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
    {
        return false;
    }
    give_back(session);
    true
}

fn run_monitor(socket: Option<UnixStream>, path: &std::path::Path, slice: &str) {
    let mut buffer = Vec::new();
    // The session is published once connect() returns; the agent sends nothing before an
    // acquire, which only a launch (after publication) sends.
    let session = loop {
        if let Some(s) = session() {
            break s;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let mut socket = match socket {
        Some(socket) => socket,
        None => reconnect(session, path, slice),
    };
    let mut seen = GATE.load(Ordering::SeqCst) >> 21;
    loop {
        let holding = GATE.load(Ordering::SeqCst) & HOLD != 0;
        // Idleness matters only when someone waits; otherwise the monitor sleeps in `read`.
        let watching = holding && CONTENDED.load(Ordering::SeqCst);
        if watching && !buffer.contains(&b'\n') && !readable_within(&socket, POLL) {
            let now = GATE.load(Ordering::SeqCst) >> 21;
            if now == seen {
                release_if_idle(session, now);
            }
            seen = GATE.load(Ordering::SeqCst) >> 21;
            continue;
        }
        let Ok(line) = read_line(&mut socket, &mut buffer) else {
            lose(session);
            socket = reconnect(session, path, slice);
            buffer.clear();
            seen = GATE.load(Ordering::SeqCst) >> 21;
            continue;
        };
        match Compute::from_wire(&line) {
            Some(Compute::Contended) => {
                leave_free();
                CONTENDED.store(true, Ordering::SeqCst);
                seen = GATE.load(Ordering::SeqCst) >> 21;
            }
            Some(message @ (Compute::Grant | Compute::Free)) => {
                CONTENDED.store(false, Ordering::SeqCst);
                let _local = session.local.lock().unwrap_or_else(|p| p.into_inner());
                FREE.store(message == Compute::Free, Ordering::SeqCst);
                GATE.fetch_or(HOLD, Ordering::SeqCst);
                session.granted.notify_all();
                seen = GATE.load(Ordering::SeqCst) >> 21;
            }
            // A yield that crossed an idle release on the way is stale.
            Some(Compute::Yield) if GATE.load(Ordering::SeqCst) & HOLD != 0 => release(session),
            _ => {}
        }
    }
}

/// Whether the agent has sent something within `wait`. `ppoll` waits to the microsecond; a
/// socket read timeout rounds up to the kernel's tick (milliseconds), too coarse to notice
/// that a holder went idle before the GPU has sat unused for long.
fn readable_within(socket: &UnixStream, wait: Duration) -> bool {
    let mut fd = libc::pollfd {
        fd: socket.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout = libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: wait.subsec_nanos() as libc::c_long,
    };
    // SAFETY: one pollfd and a timespec that live through the call; no signal mask.
    let ready = unsafe { libc::ppoll(&mut fd, 1, &timeout, std::ptr::null()) };
    // An interrupted wait counts as a quiet one: the idle check that follows is harmless.
    ready > 0
}

fn captured(stream: Handle) -> bool {
    CAPTURES.load(Ordering::Relaxed) > 0
        && CAPTURING
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|s| s.contains(&(stream as usize)))
}

/// A stream starts capturing into a graph.
pub fn capture_started(stream: Handle) {
    let mut set = CAPTURING.lock().unwrap_or_else(|p| p.into_inner());
    if set.get_or_insert_with(HashSet::new).insert(stream as usize) {
        CAPTURES.fetch_add(1, Ordering::SeqCst);
    }
}

/// A stream's capture ended.
pub fn capture_ended(stream: Handle) {
    let mut set = CAPTURING.lock().unwrap_or_else(|p| p.into_inner());
    if set.as_mut().is_some_and(|s| s.remove(&(stream as usize))) {
        CAPTURES.fetch_sub(1, Ordering::SeqCst);
    }
}
