//! The emulated `nvidia-cuda-mps-control` as NVIDIA documents the tool: `-d` returns once the
//! daemon runs in the background, commands come on standard input, `quit` ends it, and without
//! a daemon the tool says so and fails.

use std::io::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

const TOOL: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");

fn send(pipe: &Path, input: &str) -> std::process::Output {
    let mut child = Command::new(TOOL)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn the_daemon_starts_in_the_background_answers_and_quits() {
    let dir = tempfile::tempdir().unwrap();
    let (pipe, log) = (dir.path().join("pipe"), dir.path().join("log"));
    let started = Command::new(TOOL)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &log)
        .status()
        .unwrap();
    assert!(started.success());
    let pid: u32 = std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_ne!(pid, std::process::id());
    let again = Command::new(TOOL)
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
        .output()
        .unwrap();
    assert!(!again.status.success(), "a second daemon on the same pipes");
    let answered = send(
        &pipe,
        "set_default_active_thread_percentage 30\nget_default_active_thread_percentage\n",
    );
    assert_eq!(String::from_utf8_lossy(&answered.stdout), "30\n30.0\n");
    assert!(send(&pipe, "quit\n").status.success());
    let gone = send(&pipe, "get_server_list\n");
    assert!(!gone.status.success());
    assert_eq!(
        String::from_utf8_lossy(&gone.stderr).trim(),
        "Cannot find MPS control daemon process"
    );
    let logged = std::fs::read_to_string(log.join("control.log")).unwrap();
    assert!(
        logged.contains("Startup") && logged.contains("Shutdown"),
        "{logged}"
    );
}
