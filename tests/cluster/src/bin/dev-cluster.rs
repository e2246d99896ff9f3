//! Starts the test control plane for a person: prints the KUBECONFIG to use and keeps it running
//! until Ctrl-C.
//!
//!     cargo run -p gpuslice-testcluster --bin dev-cluster [-- --nodes N]

use std::time::Duration;

use gpuslice_testcluster::{Components, ControlPlane};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let nodes: usize = match args.iter().position(|a| a == "--nodes") {
        Some(i) => args.get(i + 1).ok_or("--nodes needs a number")?.parse()?,
        None => 2,
    };
    // A person needs the binaries: say how to build them rather than skip.
    let cp = match ControlPlane::start(Components::all()).await? {
        Some(cp) => cp,
        None => {
            return Err("build the control plane first: bash tests/controlplane/build.sh".into());
        }
    };
    for i in 0..nodes {
        let name = format!("gpu-node-{i}");
        cp.create_node(
            &name,
            &[("gpuslice.io/pool", "shared-a100")],
            &[("nvidia.com/gpu", "8")],
        )
        .await?;
    }
    println!("control plane ready at {}", cp.server());
    println!("export KUBECONFIG={}", cp.kubeconfig_path().display());
    println!(
        "{nodes} kwok nodes (gpu-node-*, 8 × nvidia.com/gpu each); logs in {}",
        cp.dir().display()
    );
    println!("Ctrl-C stops everything.");
    tokio::signal::ctrl_c().await?;
    drop(cp);
    tokio::time::sleep(Duration::from_millis(100)).await;
    Ok(())
}
