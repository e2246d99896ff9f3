// Programs link against `libnvidia-ml.so.1`, NVML's soname. The emulator is Rust: its
// thread-local destructors live in the library, so it must never be unmapped by dlclose
// (nvml-wrapper closes NVML when dropped) while threads that used it live on.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
