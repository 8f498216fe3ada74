//! Which requests hold a block after some ops, and in which state a block is, as a snapshot says it.

use std::collections::HashMap;

use allocsim_model::allocator::Block;
use allocsim_trace::BlockState;

use crate::program::Op;

/// The requests whose blocks are still allocated after `ops`, with their blocks' addresses
/// (`addresses`: the address each request got, `None` when it ran out of memory).
pub fn live_requests(ops: &[Op], addresses: &[Option<u64>]) -> HashMap<u32, u64> {
    let mut live = HashMap::new();
    for op in ops {
        match *op {
            Op::Malloc(q) => {
                if let Some(a) = addresses[q as usize] {
                    live.insert(q, a);
                }
            }
            Op::Free { req, .. } => {
                live.remove(&req);
            }
            _ => {}
        }
    }
    live
}

/// A block's state in `torch.cuda.memory._snapshot()` terms.
pub fn block_state(b: &Block) -> BlockState {
    if b.allocated {
        BlockState::ActiveAllocated
    } else if b.event_count > 0 {
        BlockState::ActivePendingFree
    } else {
        BlockState::Inactive
    }
}
