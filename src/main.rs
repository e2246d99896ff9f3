fn main() {
    for kind in gpuslice_api::Kind::ALL {
        println!("{}", gpuslice_api::crd::crd_yaml(kind));
    }
}
