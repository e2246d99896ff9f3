// Programs link against `libcuda.so.1`, the driver's soname; and a Rust library must never be
// unmapped by dlclose while threads that used it live on.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
