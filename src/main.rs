//! `allocsim`: replay PyTorch CUDA caching-allocator snapshots through an exact model.

mod cli;
mod explain_cmd;
mod report_cmd;
mod size;
mod synth_cmd;
mod whatif_cmds;

fn main() {
    std::process::exit(cli::main());
}
