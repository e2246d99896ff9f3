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
            if args[0] == "-d" && !daemonize() {
                return ExitCode::SUCCESS;
            }
            match mps::serve(listener, &pipe, &log) {
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

/// Forks into the background: returns true in the daemon, false in the parent (which exits
/// with success once the daemon's socket is bound, as the real tool does).
fn daemonize() -> bool {
    // SAFETY: single-threaded here (nothing has spawned a thread yet), so fork is sound; the
    // child only continues with plain Rust code.
    match unsafe { libc::fork() } {
        0 => {
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
            true
        }
        pid if pid > 0 => false,
        _ => {
            eprintln!("cannot fork: {}", std::io::Error::last_os_error());
            std::process::exit(1)
        }
    }
}
