//! The `gpuslice` command line: the arguments of each subcommand and what it runs are in
//! [`cli`], one module each; the work is in the library crates.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use gpuslice_runtime::logging::{self, LogFormat};

mod cli;

/// Fine-grained GPU sharing on Kubernetes: MIG layouts and software slices declared in Git.
#[derive(Parser)]
#[command(name = "gpuslice", version, about)]
struct Cli {
    /// How the agent and the operator log (to stderr; RUST_LOG filters, default info).
    #[arg(long, global = true, value_enum, default_value_t = LogOutput::Text)]
    log_format: LogOutput,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogOutput {
    Text,
    Json,
}

// Parsed once at start; boxing the agent's options would only move them.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Check a GitOps folder or repository: every error as file:line: Kind/name: field: reason.
    Validate(cli::validate::Args),
    /// Plan every GPU of an inventory against the pools of a source: layout now, operations, next
    /// change. With --against, what a change does: the GPUs it re-cuts, the busy slices that would
    /// block it and whose workloads they are, the windows it changes (exit 2 when it would wait
    /// for running work, 1 when it cannot be planned).
    Plan(cli::plan::Args),
    /// The node agent. Standalone: converge this node's GPUs to the pools of a folder or Git
    /// repository, every interval and at each window boundary (or once, with --once).
    Agent(cli::agent::Args),
    /// Run a command on a slice of this node: ask the agent for one that fits (waiting in line
    /// when none is free), run the command under the shim with the slice's limits, give the slice
    /// back when it ends.
    Run(cli::local::RunArgs),
    /// A dataset file through this node's local cache (a pool's io.localCache): prints the local,
    /// read-only path with the source's bytes, fetched once for all who ask.
    Cache(cli::local::CacheArgs),
    /// Tell this node's agent that GPUs were reset (after `nvidia-smi -r`), so that it lifts
    /// their XID quarantines: `1`, `0,3` or `all`. Root only. In a cluster, annotating the
    /// GpuNode `gpuslice.io/gpu-reset=<gpus>` does the same.
    GpuReset(cli::local::GpuResetArgs),
    /// Ask the operator to compact a pool now, outside its compaction window: annotates the
    /// GpuPool gpuslice.io/compact-now; the round shows in its status.compaction. Uses the
    /// in-cluster config or KUBECONFIG.
    Compact(cli::operator::CompactArgs),
    /// The operator: reconcile GpuPools into each node's desired layout (GpuNode) and pool status.
    /// Uses the in-cluster config or KUBECONFIG.
    Operator(cli::operator::Args),
    /// Benchmarks that print a table with a PASS/FAIL column and exit non-zero on FAIL.
    #[cfg(feature = "dev")]
    Bench {
        #[command(subcommand)]
        which: cli::bench::Bench,
    },
    /// Try the cluster path on this machine: a private Kubernetes control plane with fake nodes
    /// for the example pools, the chart's CRDs, roles and admission policies, the operator and an
    /// emulated agent per node as local processes, examples/gitops applied. Prints the
    /// KUBECONFIG and what to try; Ctrl-C stops everything and deletes its folder. Needs
    /// `bash tests/controlplane/build.sh` and `bash tests/helm/build.sh` once.
    #[cfg(feature = "dev")]
    Demo(cli::demo::Args),
    /// Write the CustomResourceDefinitions, generated from the API types, into a folder.
    Crds(cli::crds::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo talks to a person; its operator and agents log to its folder.
    #[cfg(feature = "dev")]
    let quiet = matches!(cli.command, Command::Demo(_));
    #[cfg(not(feature = "dev"))]
    let quiet = false;
    if !quiet {
        logging::init(match cli.log_format {
            LogOutput::Text => LogFormat::Text,
            LogOutput::Json => LogFormat::Json,
        });
    }
    let done = match cli.command {
        Command::Validate(args) => cli::validate::run(args),
        Command::Plan(args) => cli::plan::run(args),
        Command::Agent(args) => cli::agent::run(args),
        Command::Run(args) => cli::local::run(args),
        Command::Cache(args) => cli::local::cache(args),
        Command::GpuReset(args) => cli::local::gpu_reset(args),
        Command::Compact(args) => cli::operator::compact(args),
        Command::Operator(args) => cli::operator::run(args),
        #[cfg(feature = "dev")]
        Command::Bench { which } => cli::bench::run(which),
        #[cfg(feature = "dev")]
        Command::Demo(args) => cli::demo::run(args),
        Command::Crds(args) => cli::crds::run(args),
    };
    match done {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
