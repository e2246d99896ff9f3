//! The emulated `nvidia-cuda-mps-control` (see `gpuslice_emulator::mps`): `-d` starts the
//! control daemon in the background, `-f` in the foreground; without either, each line of
//! standard input is a command for the running daemon, whose reply is printed.

use std::io::BufRead;
use std::process::ExitCode;

use gpuslice_emulator::mps;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let pipe = mps::pipe_directory();
    let log = mps::log_directory();
    match args.first().map(String::as_str) {
        Some("-d") | Some("-f") => {
            let listener = match mps::bind(&pipe) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            let ready = if args[0] == "-d" {
                match daemonize() {
                    Some(ready) => Some(ready),
                    None => return ExitCode::SUCCESS,
                }
            } else {
                None
            };
            let control = pipe.join(mps::CONTROL);
            let signal = || {
                if let Some(mut ready) = ready {
                    use std::io::Write as _;
                    let _ = ready.write_all(b"1");
                }
                // A daemon whose socket is gone (its folder removed) can never be reached
                // again: it ends rather than linger.
                std::thread::spawn(move || {
                    while control.exists() {
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                    std::process::exit(0);
                });
            };
            match mps::serve(listener, &pipe, &log, signal) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some(other) => {
            eprintln!("Unknown option {other}; usage: nvidia-cuda-mps-control [-d | -f]");
            ExitCode::FAILURE
        }
        None => {
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                if line.trim().is_empty() {
                    continue;
                }
                match mps::command(&pipe, &line) {
                    Ok(reply) if reply.starts_with(mps::REFUSED) => {
                        eprint!("{reply}");
                        return ExitCode::FAILURE;
                    }
                    Ok(reply) => print!("{reply}"),
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            ExitCode::SUCCESS
        }
    }
}

/// Forks into the background: in the daemon, returns the stream on which it says it is ready;
/// in the parent, waits for that word (or the daemon's end) and returns `None`, so that the
/// caller exits once the daemon serves, as the real tool does.
fn daemonize() -> Option<std::os::unix::net::UnixStream> {
    let (parent_end, daemon_end) = match std::os::unix::net::UnixStream::pair() {
        Ok(pair) => pair,
        Err(e) => {
            eprintln!("cannot start the daemon: {e}");
            std::process::exit(1)
        }
    };
    // SAFETY: single-threaded here (nothing has spawned a thread yet), so fork is sound; the
    // child only continues with plain Rust code.
    match unsafe { libc::fork() } {
        0 => {
            drop(parent_end);
            // SAFETY: setsid takes no pointers; it detaches the daemon from the caller's session.
            unsafe { libc::setsid() };
            if let Ok(null) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
            {
                use std::os::fd::AsRawFd;
                for fd in 0..3 {
                    // SAFETY: dup2 onto the standard descriptors of this process; `null` is open.
                    unsafe { libc::dup2(null.as_raw_fd(), fd) };
                }
            }
            Some(daemon_end)
        }
        pid if pid > 0 => {
            drop(daemon_end);
            let mut word = [0u8; 1];
            match std::io::Read::read(&mut &parent_end, &mut word) {
                Ok(1) => None,
                _ => {
                    eprintln!("the MPS control daemon did not start");
                    std::process::exit(1)
                }
            }
        }
        _ => {
            eprintln!("cannot fork: {}", std::io::Error::last_os_error());
            std::process::exit(1)
        }
    }
}
