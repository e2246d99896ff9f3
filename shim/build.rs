// Preloaded into every process of a workload: it must never be unmapped while threads that ran
// its code live on.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
