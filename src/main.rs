//! `allocsim`: replay PyTorch CUDA caching-allocator snapshots through an exact model.

fn main() {
    std::process::exit(allocsim::cli::main());
}
