//! allocsim-synth: seeded synthetic memory snapshots, for scale tests and what-if experiments
//! without a GPU (`allocsim synth`).
//!
//! A generated trace looks like what `torch.cuda.memory._record_memory_history()` records on one
//! device: `alloc`, `free_requested` and `free_completed` entries with requested (unrounded) sizes,
//! unique addresses, streams, increasing `time_us`, short Python stacks (optional), and
//! `allocator_settings` of a run without `PYTORCH_CUDA_ALLOC_CONF` (an empty conf).
//!
//! What it deliberately does not contain: `segment_*` entries and final `segments`. allocsim replays
//! requests, not addresses, and a generator cannot know the segment events the allocator would make
//! without running the very model under test. So `allocsim validate` (which checks recorded segment
//! events, addresses and final segments) has nothing to check on a synthetic trace and is
//! meaningless there; `replay`, `sweep`, `fit`, `compare`, `explain` and `report` work as on a real
//! trace. Addresses come from a bump counter (each block gets a fresh 512-aligned address), so every
//! live block has a unique address and every free names a live block.
//!
//! # Workloads
//!
//! * [`Workload::Training`]: a transformer LM step loop (model size drawn from the seed). Parameters
//!   (fp32, embedding and per-layer weights, biases and norms) are allocated once; the Adam states
//!   at the first optimizer step. Each step: input ids and labels, then per layer the forward
//!   activations (norm, qkv, attention with a transient workspace, residuals, MLP) kept for the
//!   backward, the logits and the loss; the backward frees the saved activations in reverse while
//!   gradient temporaries chain through the layers and parameter gradients appear; the foreach Adam
//!   step allocates one temporary per parameter twice; `zero_grad(set_to_none=True)` frees the
//!   gradients. One 32 MiB cuBLAS workspace per stream, allocated once. With `streams > 1`,
//!   gradients are packed into 25 MiB all-reduce buckets on the other streams (DDP-like); the
//!   gradients of a bucket were used on that stream (`record_stream`), so their frees complete late
//!   (`free_completed` at the next step).
//! * [`Workload::Varlen`]: the same, with a sequence length drawn per step (64 … 4096 tokens, a
//!   multiple of 8): every activation scales with it, which is what fragments real training runs.
//! * [`Workload::KvCache`]: LLM inference serving. bf16 weights once; requests arrive (prompt 16 …
//!   2048 tokens, 16 … 1024 generated), are prefilled (transient activations), and each keeps a K and
//!   a V cache tensor per layer that grows by re-allocating a block `chunk` tokens larger (alloc the
//!   new one, free the old one) every `chunk` tokens; a decode iteration runs the whole batch
//!   (small per-layer activations, logits, sampling); finished requests free their cache. With
//!   `streams > 1` requests are spread over the streams, each stream decoding its own batch.
//! * [`Workload::Random`]: sizes log-uniform from 512 B to `max_size` (256 MiB by default; each
//!   octave equally likely, uniform within it, in integer arithmetic so a seed gives the same trace
//!   on every platform), random streams, random frees of uniformly chosen live blocks, and a live
//!   set bounded by `live_blocks` and `live_bytes` (frees come first when a bound would be
//!   exceeded; the live set grows to the bound and stays near it). With `streams > 1`, a quarter of
//!   the frees of blocks on side streams complete late.
//!
//! A trace is exactly `requests` `alloc` entries long (it ends right after the last one, so blocks
//! still live at the end stay live, as in a real snapshot). The same [`Spec`] gives the same
//! entries, byte for byte, in every format ([`rand_pcg::Pcg64Mcg`], seeded from `seed`).
//!
//! # Memory
//!
//! [`Synth`] is an iterator: entries are generated a step at a time (at most a few thousand are
//! buffered), so [`write_jsonl`] streams any number of requests to its writer in constant memory.
//! A pickle needs the whole [`Snapshot`] first (`allocsim_trace`'s pickler builds its output in
//! memory): 40 bytes per trace entry (three per request) plus the pickle itself.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;

use allocsim_trace::{Action, Frame, OutputFormat, RecordedSettings, Snapshot, StackId, TraceEntry, TraceError};
use rand::{RngExt, SeedableRng};
use rand_pcg::Pcg64Mcg;

/// What the generated program does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Workload {
    Training,
    Varlen,
    KvCache,
    Random,
}

impl Workload {
    pub const ALL: [Workload; 4] = [Workload::Training, Workload::Varlen, Workload::KvCache, Workload::Random];

    pub fn name(self) -> &'static str {
        match self {
            Workload::Training => "training",
            Workload::Varlen => "varlen",
            Workload::KvCache => "kvcache",
            Workload::Random => "random",
        }
    }

    pub fn parse(s: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name() == s)
    }
}

/// What to generate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub workload: Workload,
    /// Number of `alloc` entries (requests).
    pub requests: u64,
    pub seed: u64,
    /// Number of CUDA streams (1 … [`MAX_STREAMS`]); stream 0 is the legacy default stream.
    pub streams: u32,
    /// [`Workload::Random`]: at most this many live blocks.
    pub live_blocks: u64,
    /// [`Workload::Random`]: at most this many live bytes (requested sizes).
    pub live_bytes: u64,
    /// [`Workload::Random`]: the largest request (at least 1024).
    pub max_size: u64,
    /// Give `alloc` and free entries short Python stacks (as `context="all"` records them).
    pub frames: bool,
}

pub const MAX_STREAMS: u32 = 8;
pub const DEFAULT_LIVE_BLOCKS: u64 = 4096;
pub const DEFAULT_LIVE_BYTES: u64 = 64 << 30;
pub const DEFAULT_MAX_SIZE: u64 = 256 << 20;

impl Spec {
    pub fn new(workload: Workload, requests: u64, seed: u64) -> Spec {
        Spec {
            workload,
            requests,
            seed,
            streams: 1,
            live_blocks: DEFAULT_LIVE_BLOCKS,
            live_bytes: DEFAULT_LIVE_BYTES,
            max_size: DEFAULT_MAX_SIZE,
            frames: true,
        }
    }

    /// Why this spec cannot be generated, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.streams == 0 || self.streams > MAX_STREAMS {
            return Err(format!("--streams {} is outside 1..={MAX_STREAMS}", self.streams));
        }
        if self.workload == Workload::Random {
            if self.max_size < 1024 || self.max_size > 1 << 40 {
                return Err(format!("--max-size {} is outside 1 KiB ..= 1 TiB", self.max_size));
            }
            if self.live_blocks == 0 {
                return Err("--live-blocks must be at least 1".into());
            }
            if self.live_bytes < self.max_size {
                return Err(format!("--live-bytes {} is below --max-size {}", self.live_bytes, self.max_size));
            }
        }
        Ok(())
    }
}

/// `cudaStream_t` values: 0 (the legacy default stream), then pointer-like handles.
const STREAMS: [u64; MAX_STREAMS as usize] =
    [0, 0x55d3_a1e4_7c30, 0x55d3_a1e5_2a10, 0x55d3_a1e5_d7f0, 0x55d3_a1e6_85d0, 0x55d3_a1e7_33b0, 0x55d3_a1e7_e190, 0x55d3_a1e8_8f70];

/// Where allocations come from (each a short Python stack, innermost frame first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Site {
    Param,
    Input,
    Embedding,
    LayerNorm,
    Linear,
    Attention,
    Workspace,
    Residual,
    Gelu,
    Logits,
    Loss,
    Backward,
    AdamState,
    AdamStep,
    Bucket,
    Weights,
    Prefill,
    Cache,
    Decode,
    Sample,
    Random,
}

const N_SITES: usize = 21;

fn site_frames(s: Site) -> &'static [(&'static str, &'static str, i64)] {
    const TRAIN: (&str, &str, i64) = ("train_step", "train.py", 97);
    const MAIN: (&str, &str, i64) = ("<module>", "train.py", 214);
    const FWD: (&str, &str, i64) = ("_call_impl", "torch/nn/modules/module.py", 1784);
    const BLOCK: (&str, &str, i64) = ("forward", "model.py", 66);
    const SERVE: (&str, &str, i64) = ("serve_loop", "serve.py", 143);
    const SMAIN: (&str, &str, i64) = ("<module>", "serve.py", 301);
    match s {
        Site::Param => &[("_apply", "torch/nn/modules/module.py", 942), ("to", "torch/nn/modules/module.py", 1355), ("build_model", "train.py", 41), MAIN],
        Site::Input => &[("to_device", "train.py", 88), TRAIN, MAIN],
        Site::Embedding => &[("embedding", "torch/nn/functional.py", 2542), ("forward", "model.py", 104), FWD, TRAIN, MAIN],
        Site::LayerNorm => &[("layer_norm", "torch/nn/functional.py", 2910), ("forward", "torch/nn/modules/normalization.py", 217), BLOCK, FWD, TRAIN, MAIN],
        Site::Linear => &[("forward", "torch/nn/modules/linear.py", 125), BLOCK, FWD, TRAIN, MAIN],
        Site::Attention => &[("scaled_dot_product_attention", "model.py", 58), BLOCK, FWD, TRAIN, MAIN],
        Site::Workspace => &[("forward", "torch/nn/modules/linear.py", 125), ("forward", "model.py", 61), FWD, TRAIN, MAIN],
        Site::Residual => &[("forward", "model.py", 75), FWD, TRAIN, MAIN],
        Site::Gelu => &[("gelu", "model.py", 71), BLOCK, FWD, TRAIN, MAIN],
        Site::Logits => &[("forward", "model.py", 112), FWD, TRAIN, MAIN],
        Site::Loss => &[("cross_entropy", "torch/nn/functional.py", 3494), ("train_step", "train.py", 101), MAIN],
        Site::Backward => &[
            ("_engine_run_backward", "torch/autograd/graph.py", 829),
            ("backward", "torch/autograd/__init__.py", 353),
            ("backward", "torch/_tensor.py", 626),
            ("train_step", "train.py", 104),
            MAIN,
        ],
        Site::AdamState => &[("_init_group", "torch/optim/adam.py", 173), ("step", "torch/optim/adam.py", 235), ("train_step", "train.py", 106), MAIN],
        Site::AdamStep => &[
            ("_multi_tensor_adam", "torch/optim/adam.py", 641),
            ("adam", "torch/optim/adam.py", 955),
            ("step", "torch/optim/adam.py", 247),
            ("train_step", "train.py", 106),
            MAIN,
        ],
        Site::Bucket => &[("_allreduce_bucket", "ddp.py", 52), ("_engine_run_backward", "torch/autograd/graph.py", 829), ("train_step", "train.py", 104), MAIN],
        Site::Weights => &[("load_state_dict", "serve.py", 37), ("load_model", "serve.py", 29), SMAIN],
        Site::Prefill => &[("forward", "model.py", 66), ("prefill", "serve.py", 88), SERVE, SMAIN],
        Site::Cache => &[("update", "cache.py", 24), ("forward", "model.py", 58), ("decode", "serve.py", 102), SERVE, SMAIN],
        Site::Decode => &[("forward", "model.py", 66), ("decode", "serve.py", 102), SERVE, SMAIN],
        Site::Sample => &[("sample", "serve.py", 117), SERVE, SMAIN],
        Site::Random => &[("random_op", "synthetic.py", 30), ("<module>", "synthetic.py", 55)],
    }
}

/// A generated block.
#[derive(Clone, Copy, Debug)]
struct Blk {
    addr: u64,
    size: u64,
    stream: u64,
    stack: StackId,
}

/// Where the generators put their entries: addresses, times, stacks.
struct Emit {
    buf: VecDeque<TraceEntry>,
    rng: Pcg64Mcg,
    next_addr: u64,
    time_us: i64,
    /// `free_requested` written, `free_completed` not yet.
    deferred: Vec<Blk>,
    frames: bool,
    /// Stack id per site (0: not used yet); ids are given in first-use order.
    site_stack: [StackId; N_SITES],
    stacks: Vec<Vec<Frame>>,
}

/// The first address handed out (where a job's first segment typically lands).
const BASE_ADDR: u64 = 0x7f3a_0000_0000;
/// The first `time_us` (microseconds since the epoch, mid 2025).
const BASE_TIME_US: i64 = 1_750_000_000_000_000;

impl Emit {
    fn new(seed: u64, frames: bool) -> Emit {
        Emit {
            buf: VecDeque::new(),
            rng: Pcg64Mcg::seed_from_u64(seed),
            next_addr: BASE_ADDR,
            time_us: BASE_TIME_US,
            deferred: Vec::new(),
            frames,
            site_stack: [0; N_SITES],
            stacks: vec![Vec::new()],
        }
    }

    fn stack(&mut self, site: Site) -> StackId {
        if !self.frames {
            return 0;
        }
        let i = site as usize;
        if self.site_stack[i] == 0 {
            self.site_stack[i] = self.stacks.len() as StackId;
            self.stacks.push(site_frames(site).iter().map(|&(n, f, l)| Frame { name: n.into(), filename: f.into(), line: l }).collect());
        }
        self.site_stack[i]
    }

    fn push(&mut self, action: Action, b: &Blk) {
        self.time_us += self.rng.random_range(1..=16i64);
        self.buf.push_back(TraceEntry { action, addr: b.addr, size: b.size, stream: b.stream, time_us: self.time_us, stack: b.stack, meta: 0 });
    }

    fn alloc(&mut self, size: u64, stream: u64, site: Site) -> Blk {
        let size = size.max(1);
        let b = Blk { addr: self.next_addr, size, stream, stack: self.stack(site) };
        self.next_addr += size.div_ceil(512) * 512;
        self.push(Action::Alloc, &b);
        b
    }

    /// An ordinary free: `free_requested` then `free_completed`.
    fn free(&mut self, b: Blk) {
        self.push(Action::FreeRequested, &b);
        self.push(Action::FreeCompleted, &b);
    }

    /// A free of a block used on another stream (`record_stream`): completes at the next
    /// [`Emit::complete_deferred`].
    fn free_deferred(&mut self, b: Blk) {
        self.push(Action::FreeRequested, &b);
        self.deferred.push(b);
    }

    fn complete_deferred(&mut self) {
        for b in std::mem::take(&mut self.deferred) {
            self.push(Action::FreeCompleted, &b);
        }
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.rng.random_range(0..xs.len())]
    }

    /// `1 … 100` < `pct`.
    fn chance(&mut self, pct: u32) -> bool {
        self.rng.random_range(0..100u32) < pct
    }
}

// ---------------------------------------------------------------------------------------------
// A transformer's shapes.

#[derive(Clone, Copy, Debug)]
struct Model {
    layers: u64,
    h: u64,
    vocab: u64,
    heads: u64,
    kv_heads: u64,
}

const HEAD_DIM: u64 = 128;

impl Model {
    fn pick(e: &mut Emit, hs: &[u64], layers: std::ops::RangeInclusive<u64>) -> Model {
        let h = e.pick(hs);
        let heads = h / HEAD_DIM;
        let kv_heads = heads / e.pick(&[1, 2, 4]);
        Model { layers: e.rng.random_range(layers), h, vocab: e.pick(&[32000, 32768, 50257]), heads, kv_heads }
    }

    /// Output width of the fused qkv projection.
    fn qkv(&self) -> u64 {
        self.h + 2 * self.kv_heads * HEAD_DIM
    }

    /// Parameter element counts of one layer: norm w/b, qkv w/b, proj w/b, norm w/b, fc1 w/b, fc2 w/b.
    fn layer_params(&self) -> [u64; 12] {
        let (h, f) = (self.h, 4 * self.h);
        [h, h, self.qkv() * h, self.qkv(), h * h, h, h, h, f * h, f, h * f, h]
    }

    /// Every parameter's element count: embedding (tied with the LM head), the layers, the final norm.
    fn params(&self) -> Vec<u64> {
        let mut v = vec![self.vocab * self.h];
        for _ in 0..self.layers {
            v.extend_from_slice(&self.layer_params());
        }
        v.extend_from_slice(&[self.h, self.h]);
        v
    }
}

// ---------------------------------------------------------------------------------------------
// Training and variable-length training.

struct Training {
    m: Model,
    varlen: bool,
    batch: u64,
    seq: u64,
    streams: Vec<u64>,
    /// Parameter element counts (fp32).
    params: Vec<u64>,
    param_blocks: Vec<Blk>,
    adam: Vec<Blk>,
    workspaces: Vec<Blk>,
    setup_done: bool,
    buckets: u64,
}

const BUCKET_BYTES: u64 = 25 << 20;
const CUBLAS_WORKSPACE: u64 = 32 << 20;

impl Training {
    fn new(e: &mut Emit, varlen: bool, streams: u32) -> Training {
        let m = Model::pick(e, &[1024, 1536, 2048], 8..=24);
        let batch = e.pick(&[4, 8, 16]);
        let seq = if varlen { 4096 } else { e.pick(&[512, 1024, 2048]) };
        Training {
            m,
            varlen,
            batch: if varlen { batch / 2 } else { batch },
            seq,
            streams: STREAMS[..streams as usize].to_vec(),
            params: m.params(),
            param_blocks: Vec::new(),
            adam: Vec::new(),
            workspaces: Vec::new(),
            setup_done: false,
            buckets: 0,
        }
    }

    fn refill(&mut self, e: &mut Emit) {
        if !self.setup_done {
            for &n in &self.params {
                let b = e.alloc(4 * n, 0, Site::Param);
                self.param_blocks.push(b);
            }
            self.setup_done = true;
            return;
        }
        self.step(e);
    }

    fn step(&mut self, e: &mut Emit) {
        e.complete_deferred();
        let m = self.m;
        let s = if self.varlen { e.rng.random_range(8..=self.seq / 8) * 8 } else { self.seq };
        let t = self.batch * s;
        let a = t * m.h * 2; // one bf16 activation
        let s0 = self.streams[0];
        let ids = e.alloc(t * 8, s0, Site::Input);
        let labels = e.alloc(t * 8, s0, Site::Input);
        if self.workspaces.is_empty() {
            for i in 0..self.streams.len() {
                let w = e.alloc(CUBLAS_WORKSPACE, self.streams[i], Site::Workspace);
                self.workspaces.push(w);
            }
        }
        // Forward: each layer keeps its input and its activations for the backward.
        let mut x = e.alloc(a, s0, Site::Embedding);
        let mut saved: Vec<Vec<Blk>> = Vec::with_capacity(m.layers as usize);
        for _ in 0..m.layers {
            let mut keep = vec![x];
            keep.push(e.alloc(a, s0, Site::LayerNorm));
            keep.push(e.alloc(t * 4, s0, Site::LayerNorm));
            keep.push(e.alloc(t * 4, s0, Site::LayerNorm));
            keep.push(e.alloc(t * m.qkv() * 2, s0, Site::Linear));
            let ws_size = e.rng.random_range(1u64..=16) << 20;
            let ws = e.alloc(ws_size, s0, Site::Attention);
            keep.push(e.alloc(a, s0, Site::Attention));
            keep.push(e.alloc(self.batch * m.heads * s * 4, s0, Site::Attention));
            e.free(ws);
            let proj = e.alloc(a, s0, Site::Linear);
            let x1 = e.alloc(a, s0, Site::Residual);
            e.free(proj);
            keep.push(x1);
            keep.push(e.alloc(a, s0, Site::LayerNorm));
            keep.push(e.alloc(t * 4, s0, Site::LayerNorm));
            keep.push(e.alloc(t * 4, s0, Site::LayerNorm));
            keep.push(e.alloc(4 * a, s0, Site::Linear));
            keep.push(e.alloc(4 * a, s0, Site::Gelu));
            let fc2 = e.alloc(a, s0, Site::Linear);
            x = e.alloc(a, s0, Site::Residual);
            e.free(fc2);
            saved.push(keep);
        }
        let lnf = e.alloc(a, s0, Site::LayerNorm);
        let lnf_stats = [e.alloc(t * 4, s0, Site::LayerNorm), e.alloc(t * 4, s0, Site::LayerNorm)];
        let logits = e.alloc(t * m.vocab * 2, s0, Site::Logits);
        let logits32 = e.alloc(t * m.vocab * 4, s0, Site::Loss);
        e.free(logits);
        let lse = e.alloc(t * 4, s0, Site::Loss);
        let loss = e.alloc(4, s0, Site::Loss);

        // Backward.
        let mut grads: Vec<(Blk, bool)> = Vec::with_capacity(self.params.len());
        let mut bucket = BucketState::default();
        let g32 = e.alloc(t * m.vocab * 4, s0, Site::Backward);
        e.free(logits32);
        e.free(lse);
        let g16 = e.alloc(t * m.vocab * 2, s0, Site::Backward);
        e.free(g32);
        let g_emb = e.alloc(4 * self.params[0], s0, Site::Backward);
        let mut gx = e.alloc(a, s0, Site::Backward);
        e.free(g16);
        e.free(lnf);
        for b in lnf_stats {
            e.free(b);
        }
        e.free(x);
        let n = self.params.len();
        for b in [n - 1, n - 2] {
            let g = e.alloc(4 * self.params[b], s0, Site::Backward);
            grads.push((g, false));
            self.bucket_add(e, &mut bucket, grads.len() - 1, &mut grads);
        }
        for l in (0..m.layers as usize).rev() {
            let keep = std::mem::take(&mut saved[l]);
            let mut layer_grads: Vec<u64> = self.m.layer_params().to_vec();
            for (k, blk) in keep.into_iter().enumerate().rev() {
                if blk.size >= a && k > 0 {
                    // The gradient w.r.t. this activation replaces the running one.
                    let g = e.alloc(blk.size, s0, Site::Backward);
                    e.free(gx);
                    gx = g;
                }
                e.free(blk);
                if let Some(p) = layer_grads.pop() {
                    let g = e.alloc(4 * p, s0, Site::Backward);
                    grads.push((g, false));
                    self.bucket_add(e, &mut bucket, grads.len() - 1, &mut grads);
                }
            }
            if gx.size != a {
                let g = e.alloc(a, s0, Site::Backward);
                e.free(gx);
                gx = g;
            }
        }
        grads.push((g_emb, false));
        self.bucket_add(e, &mut bucket, grads.len() - 1, &mut grads);
        self.bucket_flush(e, &mut bucket, &mut grads);
        for b in bucket.inflight.drain(..) {
            e.free(b);
        }
        e.free(gx);
        e.free(ids);
        e.free(labels);

        // Optimizer: Adam states at the first step, then the foreach temporaries.
        if self.adam.is_empty() {
            for &p in &self.params {
                let ea = e.alloc(4 * p, s0, Site::AdamState);
                let eas = e.alloc(4 * p, s0, Site::AdamState);
                self.adam.push(ea);
                self.adam.push(eas);
            }
        }
        for _ in 0..2 {
            let tmps: Vec<Blk> = self.params.iter().map(|&p| e.alloc(4 * p, s0, Site::AdamStep)).collect();
            for b in tmps {
                e.free(b);
            }
        }
        e.free(loss);
        // zero_grad(set_to_none=True).
        for (g, recorded) in grads {
            if recorded {
                e.free_deferred(g);
            } else {
                e.free(g);
            }
        }
    }

    /// Adds gradient `i` to the current all-reduce bucket (with more than one stream).
    fn bucket_add(&mut self, e: &mut Emit, st: &mut BucketState, i: usize, grads: &mut [(Blk, bool)]) {
        if self.streams.len() < 2 {
            return;
        }
        st.members.push(i);
        st.bytes += grads[i].0.size;
        if st.bytes >= BUCKET_BYTES {
            self.bucket_flush(e, st, grads);
        }
    }

    fn bucket_flush(&mut self, e: &mut Emit, st: &mut BucketState, grads: &mut [(Blk, bool)]) {
        if st.members.is_empty() {
            return;
        }
        let side = self.streams[1 + (self.buckets as usize % (self.streams.len() - 1))];
        self.buckets += 1;
        // The previous bucket's all-reduce has finished by now.
        if st.inflight.len() >= 2 {
            let old = st.inflight.remove(0);
            e.free(old);
        }
        let b = e.alloc(st.bytes, side, Site::Bucket);
        st.inflight.push(b);
        for &i in &st.members {
            grads[i].1 = true;
        }
        st.members.clear();
        st.bytes = 0;
    }
}

#[derive(Default)]
struct BucketState {
    members: Vec<usize>,
    bytes: u64,
    inflight: Vec<Blk>,
}

// ---------------------------------------------------------------------------------------------
// KV-cache growth (inference serving).

struct KvCache {
    m: Model,
    streams: Vec<u64>,
    max_batch: usize,
    /// The cache grows by this many tokens at a time.
    chunk: u64,
    active: Vec<Seq>,
    loaded: bool,
    next_id: u64,
}

struct Seq {
    stream: u64,
    tokens: u64,
    end: u64,
    cap: u64,
    /// K and V per layer.
    cache: Vec<Blk>,
}

impl KvCache {
    fn new(e: &mut Emit, streams: u32) -> KvCache {
        let m = Model::pick(e, &[2048, 4096], 16..=32);
        KvCache {
            m,
            streams: STREAMS[..streams as usize].to_vec(),
            max_batch: e.pick(&[8, 16, 32]),
            chunk: e.pick(&[16, 32, 64, 128]),
            active: Vec::new(),
            loaded: false,
            next_id: 0,
        }
    }

    fn kv_bytes(&self, tokens: u64) -> u64 {
        tokens * self.m.kv_heads * HEAD_DIM * 2
    }

    fn refill(&mut self, e: &mut Emit) {
        let m = self.m;
        if !self.loaded {
            for n in m.params() {
                e.alloc(2 * n, 0, Site::Weights);
            }
            self.loaded = true;
            return;
        }
        // Arrivals: at least one when idle, a few at most per iteration.
        let mut arrivals = 0;
        while self.active.len() < self.max_batch && arrivals < 4 && (self.active.is_empty() || e.chance(30)) {
            self.admit(e);
            arrivals += 1;
        }
        // One decode iteration per stream.
        for &st in &self.streams.clone() {
            let idx: Vec<usize> = (0..self.active.len()).filter(|&i| self.active[i].stream == st).collect();
            if idx.is_empty() {
                continue;
            }
            let b = idx.len() as u64;
            let grow: Vec<bool> = idx.iter().map(|&i| self.active[i].tokens + 1 > self.active[i].cap).collect();
            let mut x = e.alloc(b * m.h * 2, st, Site::Decode);
            for l in 0..m.layers as usize {
                let n = e.alloc(b * m.h * 2, st, Site::Decode);
                let qkv = e.alloc(b * m.qkv() * 2, st, Site::Decode);
                for (j, &i) in idx.iter().enumerate() {
                    if !grow[j] {
                        continue;
                    }
                    let cap = self.active[i].cap + self.chunk;
                    for kv in 0..2 {
                        let nb = e.alloc(self.kv_bytes(cap), st, Site::Cache);
                        let old = std::mem::replace(&mut self.active[i].cache[2 * l + kv], nb);
                        e.free(old);
                    }
                }
                let att = e.alloc(b * m.h * 2, st, Site::Decode);
                e.free(qkv);
                e.free(n);
                let up = e.alloc(b * 4 * m.h * 2, st, Site::Decode);
                let act = e.alloc(b * 4 * m.h * 2, st, Site::Decode);
                e.free(up);
                let out = e.alloc(b * m.h * 2, st, Site::Decode);
                e.free(act);
                e.free(att);
                e.free(x);
                x = out;
            }
            let logits = e.alloc(b * m.vocab * 4, st, Site::Sample);
            e.free(x);
            let probs = e.alloc(b * m.vocab * 4, st, Site::Sample);
            e.free(logits);
            let next = e.alloc(b * 8, st, Site::Sample);
            e.free(probs);
            e.free(next);
            for (j, &i) in idx.iter().enumerate() {
                let s = &mut self.active[i];
                if grow[j] {
                    s.cap += self.chunk;
                }
                s.tokens += 1;
            }
        }
        // Finished requests free their cache.
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].tokens >= self.active[i].end {
                let s = self.active.swap_remove(i);
                for b in s.cache {
                    e.free(b);
                }
            } else {
                i += 1;
            }
        }
    }

    fn admit(&mut self, e: &mut Emit) {
        let m = self.m;
        let p = e.rng.random_range(16..=2048u64);
        let g = e.rng.random_range(16..=1024u64);
        let st = self.streams[(self.next_id % self.streams.len() as u64) as usize];
        self.next_id += 1;
        let a = p * m.h * 2;
        let cap = (p + 1).div_ceil(self.chunk) * self.chunk;
        let mut cache = Vec::with_capacity(2 * m.layers as usize);
        let mut x = e.alloc(a, st, Site::Prefill);
        for _ in 0..m.layers {
            let n = e.alloc(a, st, Site::Prefill);
            let qkv = e.alloc(p * m.qkv() * 2, st, Site::Prefill);
            cache.push(e.alloc(self.kv_bytes(cap), st, Site::Cache));
            cache.push(e.alloc(self.kv_bytes(cap), st, Site::Cache));
            let att = e.alloc(a, st, Site::Prefill);
            e.free(qkv);
            e.free(n);
            let up = e.alloc(4 * a, st, Site::Prefill);
            let act = e.alloc(4 * a, st, Site::Prefill);
            e.free(up);
            let out = e.alloc(a, st, Site::Prefill);
            e.free(act);
            e.free(att);
            e.free(x);
            x = out;
        }
        let logits = e.alloc(m.vocab * 4, st, Site::Sample);
        e.free(x);
        e.free(logits);
        self.active.push(Seq { stream: st, tokens: p, end: p + g, cap, cache });
    }
}

// ---------------------------------------------------------------------------------------------
// Random.

struct Random {
    streams: Vec<u64>,
    live: Vec<Blk>,
    live_bytes: u64,
    max_blocks: u64,
    max_bytes: u64,
    max_size: u64,
}

impl Random {
    fn new(spec: &Spec) -> Random {
        Random {
            streams: STREAMS[..spec.streams as usize].to_vec(),
            live: Vec::new(),
            live_bytes: 0,
            max_blocks: spec.live_blocks,
            max_bytes: spec.live_bytes,
            max_size: spec.max_size,
        }
    }

    /// Log-uniform in 512 ..= max_size: an octave uniformly, then uniform within it.
    fn size(&self, e: &mut Emit) -> u64 {
        let top = 63 - self.max_size.leading_zeros(); // 2^top <= max_size
        let k = e.rng.random_range(9..=top);
        let lo = 1u64 << k;
        let hi = (lo << 1).min(self.max_size + 1);
        if hi <= lo { lo } else { e.rng.random_range(lo..hi) }
    }

    fn free_one(&mut self, e: &mut Emit) {
        let i = e.rng.random_range(0..self.live.len());
        let b = self.live.swap_remove(i);
        self.live_bytes -= b.size;
        if b.stream != self.streams[0] && e.chance(25) {
            e.free_deferred(b);
        } else {
            e.free(b);
        }
    }

    fn refill(&mut self, e: &mut Emit) {
        e.complete_deferred();
        let size = self.size(e);
        while !self.live.is_empty() && (self.live.len() as u64 >= self.max_blocks || self.live_bytes + size > self.max_bytes) {
            self.free_one(e);
        }
        let st = e.pick(&self.streams);
        let b = e.alloc(size, st, Site::Random);
        self.live.push(b);
        self.live_bytes += size;
        if self.live.len() > 1 && e.chance(30) {
            self.free_one(e);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The iterator.

enum Gen {
    Training(Box<Training>),
    KvCache(Box<KvCache>),
    Random(Box<Random>),
}

/// Counts of what has been generated so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// `alloc` entries.
    pub requests: u64,
    /// Trace entries.
    pub entries: u64,
    /// Requested bytes of the blocks allocated and not yet `free_completed`.
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub peak_live_bytes: u64,
    pub peak_live_blocks: u64,
    /// Frees whose `free_completed` came later than right after the `free_requested`.
    pub deferred_frees: u64,
}

/// The trace entries of a [`Spec`], oldest first (an iterator; see the crate documentation).
pub struct Synth {
    emit: Emit,
    generator: Gen,
    left: u64,
    stats: Stats,
    /// The highest stack id handed out so far.
    max_stack: StackId,
    /// The previous entry's action and address.
    last: Option<(Action, u64)>,
}

impl Synth {
    /// Panics if the spec is invalid (see [`Spec::check`]).
    pub fn new(spec: &Spec) -> Synth {
        if let Err(e) = spec.check() {
            panic!("invalid synth spec: {e}");
        }
        // A workload's own stream of random numbers: the same seed gives different workloads
        // unrelated draws.
        let seed = spec.seed ^ (spec.workload as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut emit = Emit::new(seed, spec.frames);
        let generator = match spec.workload {
            Workload::Training => Gen::Training(Box::new(Training::new(&mut emit, false, spec.streams))),
            Workload::Varlen => Gen::Training(Box::new(Training::new(&mut emit, true, spec.streams))),
            Workload::KvCache => Gen::KvCache(Box::new(KvCache::new(&mut emit, spec.streams))),
            Workload::Random => Gen::Random(Box::new(Random::new(spec))),
        };
        Synth { emit, generator, left: spec.requests, stats: Stats::default(), max_stack: 0, last: None }
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    /// The stacks the entries returned so far refer to (`[0]` is the empty stack).
    pub fn stacks(&self) -> &[Vec<Frame>] {
        &self.emit.stacks[..=self.max_stack as usize]
    }

    fn account(&mut self, e: &TraceEntry) {
        let s = &mut self.stats;
        s.entries += 1;
        match e.action {
            Action::Alloc => {
                s.requests += 1;
                s.live_bytes += e.size;
                s.live_blocks += 1;
                s.peak_live_bytes = s.peak_live_bytes.max(s.live_bytes);
                s.peak_live_blocks = s.peak_live_blocks.max(s.live_blocks);
            }
            Action::FreeCompleted => {
                s.live_bytes -= e.size;
                s.live_blocks -= 1;
                if self.last != Some((Action::FreeRequested, e.addr)) {
                    s.deferred_frees += 1;
                }
            }
            _ => {}
        }
        self.last = Some((e.action, e.addr));
        self.max_stack = self.max_stack.max(e.stack);
    }
}

impl Iterator for Synth {
    type Item = TraceEntry;

    fn next(&mut self) -> Option<TraceEntry> {
        loop {
            if let Some(e) = self.emit.buf.pop_front() {
                if e.action == Action::Alloc {
                    self.left -= 1;
                    if self.left == 0 {
                        // The trace ends at its last request.
                        self.emit.buf.clear();
                    }
                }
                self.account(&e);
                return Some(e);
            }
            if self.left == 0 {
                return None;
            }
            match &mut self.generator {
                Gen::Training(g) => g.refill(&mut self.emit),
                Gen::KvCache(g) => g.refill(&mut self.emit),
                Gen::Random(g) => g.refill(&mut self.emit),
            }
        }
    }
}

/// `allocator_settings` of a torch 2.11 run without `PYTORCH_CUDA_ALLOC_CONF`.
pub fn settings() -> RecordedSettings {
    RecordedSettings::torch_default()
}

/// The whole trace as a [`Snapshot`] (one device, no segments), and what was generated.
pub fn snapshot(spec: &Spec) -> (Snapshot, Stats) {
    let mut s = Synth::new(spec);
    let entries: Vec<TraceEntry> = s.by_ref().collect();
    let snap = Snapshot { device_traces: vec![entries], settings: settings(), stacks: s.stacks().to_vec(), ..Default::default() };
    (snap, s.stats())
}

/// Streams the trace as allocsim JSON Lines to `out` (buffer it): the same bytes
/// `allocsim_trace::jsonl::write` writes for [`snapshot`]'s result, without holding the entries.
pub fn write_jsonl(spec: &Spec, out: &mut impl Write) -> std::io::Result<Stats> {
    // The header, from the trace crate's own writer: a snapshot of one empty device.
    let head = Snapshot { device_traces: vec![Vec::new()], settings: settings(), ..Default::default() };
    allocsim_trace::jsonl::write(&head, out)?;
    let mut s = Synth::new(spec);
    let mut frames_json: Vec<Vec<u8>> = Vec::new();
    let mut line = Vec::with_capacity(512);
    while let Some(e) = s.next() {
        let id = e.stack as usize;
        while frames_json.len() <= id {
            let k = frames_json.len();
            let frames = &s.emit.stacks[k];
            frames_json.push(if frames.is_empty() {
                Vec::new()
            } else {
                let mut v = b",\"frames\":".to_vec();
                serde_json::to_writer(&mut v, frames).map_err(std::io::Error::other)?;
                v
            });
        }
        line.clear();
        line.extend_from_slice(b"{\"device\":0,\"action\":\"");
        line.extend_from_slice(e.action.as_str().as_bytes());
        line.extend_from_slice(b"\",\"addr\":");
        push_u64(&mut line, e.addr);
        line.extend_from_slice(b",\"size\":");
        push_u64(&mut line, e.size);
        line.extend_from_slice(b",\"stream\":");
        push_u64(&mut line, e.stream);
        line.extend_from_slice(b",\"time_us\":");
        push_u64(&mut line, e.time_us as u64);
        line.extend_from_slice(&frames_json[id]);
        line.extend_from_slice(b"}\n");
        out.write_all(&line)?;
    }
    Ok(s.stats())
}

fn push_u64(out: &mut Vec<u8>, mut v: u64) {
    let mut tmp = [0u8; 20];
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend_from_slice(&tmp[i..]);
}

/// Writes the trace to `path` in the format its name asks for (`.jsonl`, `.pickle`, each
/// optionally `.gz`; see [`OutputFormat::from_path`]). JSON Lines is streamed; a pickle is built
/// in memory first.
pub fn write_file(spec: &Spec, path: &Path) -> Result<Stats, TraceError> {
    let io = |e| TraceError::Io { path: path.display().to_string(), source: e };
    match OutputFormat::from_path(path) {
        Some((OutputFormat::Jsonl, gzip)) => {
            let f = std::fs::File::create(path).map_err(io)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            let stats = if gzip {
                let mut gz = flate2::write::GzEncoder::new(&mut w, flate2::Compression::default());
                let st = write_jsonl(spec, &mut gz).map_err(io)?;
                gz.finish().map_err(io)?;
                st
            } else {
                write_jsonl(spec, &mut w).map_err(io)?
            };
            w.flush().map_err(io)?;
            Ok(stats)
        }
        None => {
            Err(io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "unknown output format: name the file *.jsonl, *.jsonl.gz, *.pickle or *.pickle.gz")))
        }
        Some((OutputFormat::Pickle, _)) => {
            let (snap, stats) = snapshot(spec);
            allocsim_trace::write_trace(&snap, path)?;
            Ok(stats)
        }
    }
}
