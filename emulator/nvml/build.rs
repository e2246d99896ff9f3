// The emulator is Rust: its thread-local destructors live in the library, so it must never be
// unmapped by dlclose (nvml-wrapper closes NVML when dropped) while threads that used it live on.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
