//! Settling the sizes of blocks that a truncated trace frees but allocated before it started.
//!
//! [`crate::restore`] gives such a block its rounded request size unless the trace shows where it
//! ended (the first allocation in the free block after it starts at its end). When the block was
//! in fact up to 1 MiB larger (it was not split when allocated), the free block after it is
//! smaller than assumed, and a later request may fit the assumed free block but not the real one.
//! [`settle_block_sizes`] replays under the trace's own settings and addresses; where the first
//! request that lands elsewhere than recorded went into the free block right after such a block
//! while it was alive, the real free block was too small for it, so the block is grown just enough
//! (within the 1 MiB it may exceed its rounded size by), and the replay is tried again.

use allocsim_model::constants::{K_MIN_BLOCK_SIZE, K_SMALL_SIZE};
use allocsim_trace::TraceEntry;

use allocsim_program::program::{Op, Program};
use allocsim_program::replay::{EmptyCacheCalls, ReplayOptions, replay};

/// Grows inferred block sizes of `program.initial` while that fixes the first misplaced request,
/// at most `max_rounds` times. Returns the number of blocks grown.
pub fn settle_block_sizes(program: &mut Program, trace: &[TraceEntry], opts: &ReplayOptions, max_rounds: usize) -> u32 {
    let mut grown = 0;
    while (grown as usize) < max_rounds {
        let Some(init) = &program.initial else { break };
        if init.inferred_sizes == 0 {
            break;
        }
        let out = replay(program, opts, EmptyCacheCalls::Infer(trace));
        let first = program.requests.iter().enumerate().find_map(|(i, r)| match out.addresses[i] {
            Some(a) if !r.recorded_oom && a != r.recorded_addr => Some((i, a)),
            _ => None,
        });
        let Some((q, at)) = first else { break };
        let r = program.requests[q];
        let alive = |f: Option<u32>| f.is_none_or(|f| f > r.trace_index);
        let Some(k) = init.blocks.iter().position(|b| b.size_inferred && b.slack > 0 && b.addr + b.size == at && alive(b.freed_at)) else {
            break;
        };
        let Some(op) = program.ops.iter().position(|o| *o == Op::Malloc(q as u32)) else { break };
        let before = Program { ops: program.ops[..op].to_vec(), ..program.clone() };
        let state = replay(&before, opts, EmptyCacheCalls::Given(&out.empty_cache[..op]));
        let Some(found) = state.allocator.live_blocks().find(|(_, b)| b.ptr == at && !b.allocated).map(|(_, b)| b.size) else {
            break;
        };
        let b = &init.blocks[k];
        let least = opts.config.round_size(b.requested_size);
        let mut size = b.size + found.saturating_sub(opts.config.round_size(r.size)) + K_MIN_BLOCK_SIZE;
        if size < b.room && b.room - size <= K_SMALL_SIZE {
            size = b.room; // a large-pool free block is larger than 1 MiB
        }
        if size > b.room || size > least + b.slack {
            break;
        }
        if let Some(init) = program.initial.as_mut() {
            init.blocks[k].size = size;
        }
        grown += 1;
    }
    grown
}
