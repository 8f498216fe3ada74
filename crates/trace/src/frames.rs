//! Which frame of a recorded stack is the call site a user wants to see.
//!
//! `_record_memory_history()` records C++ frames by default (`stacks="all"`): a stack starts with
//! the unwinder (`torch::unwind::unwind()`, `torch::CapturedTraceback::gather`), the allocator
//! (`c10::cuda::CUDACachingAllocator::…::malloc`), the ATen dispatch (`at::native::empty_cuda`,
//! `at::_ops::…`), CPython's own C functions (`_PyEval_EvalFrameDefault`, filename `??`) and the
//! C library, with the Python frames after or among them. The call site is the first frame in
//! the user's code: the first Python frame outside PyTorch's own package
//! (`torch/nn/modules/module.py`, `torch/_tensor.py`, `torch/autograd/…`, `torch/utils/…`).
//! When there is none, the first Python frame (in PyTorch), else the first C++ frame that names
//! an operation rather than the allocator's plumbing (`at::native::_to_copy`), else the first
//! frame.

use crate::Frame;

/// What kind of code a frame is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A Python frame in the user's code (or a library other than PyTorch).
    User,
    /// A Python frame in PyTorch's own package.
    Torch,
    /// A frame Python runs that is no one's source (`<frozen importlib._bootstrap>`, `<string>`).
    PythonInternal,
    /// A C/C++ frame: PyTorch's, CPython's, the C library's.
    Native,
}

/// PyTorch's top-level modules and packages, as they appear after `…/torch/` in a source checkout
/// (an installed torch is recognised by `site-packages/torch/` or `dist-packages/torch/`).
const TORCH_TOP: &[&str] = &[
    "_",
    "nn/",
    "autograd/",
    "utils/",
    "cuda/",
    "distributed/",
    "optim/",
    "fx/",
    "amp/",
    "jit/",
    "export/",
    "profiler/",
    "functional.py",
    "overrides.py",
    "library.py",
    "random.py",
    "serialization.py",
    "storage.py",
    "__init__.py",
    "testing/",
    "backends/",
    "func/",
    "sparse/",
    "nested/",
    "special/",
    "linalg/",
    "fft/",
    "masked/",
    "onnx/",
    "quantization/",
    "ao/",
    "compiler/",
    "multiprocessing/",
    "distributions/",
    "package/",
    "hub.py",
    "types.py",
    "return_types.py",
    "signal/",
    "xpu/",
    "mps/",
    "accelerator/",
    "mtia/",
    "cpu/",
];

/// Where a Python file lives: PyTorch's package, or not.
fn is_torch_file(filename: &str) -> bool {
    let f = filename.replace('\\', "/");
    if f.contains("site-packages/torch/") || f.contains("dist-packages/torch/") {
        return true;
    }
    let rest = match f.rfind("/torch/") {
        Some(i) => &f[i + "/torch/".len()..],
        None => match f.strip_prefix("torch/") {
            Some(r) => r,
            None => return false,
        },
    };
    TORCH_TOP.iter().any(|t| rest.starts_with(t))
}

/// Classifies one frame.
pub fn kind(f: &Frame) -> FrameKind {
    let name = f.filename.as_str();
    if name.starts_with('<') {
        // `<ipython-input-3-…>`, `<stdin>` are the user's; `<frozen …>`, `<string>` (exec),
        // `<eval_with_key>.N` (torch.fx's generated code) are not.
        return if name.starts_with("<frozen") || name == "<string>" || name.starts_with("<eval_with_key>") || name == "<built-in>" {
            FrameKind::PythonInternal
        } else {
            FrameKind::User
        };
    }
    if !(name.ends_with(".py") || name.ends_with(".pyx") || name.ends_with(".pyi")) {
        return FrameKind::Native;
    }
    if is_torch_file(name) { FrameKind::Torch } else { FrameKind::User }
}

/// Whether a native frame is the unwinder, the allocator or the generic tensor-creation plumbing
/// every allocation passes through (it says nothing about which operation allocated).
fn is_plumbing(f: &Frame) -> bool {
    let n = f.name.as_str();
    const PREFIXES: &[&str] = &[
        "torch::unwind::",
        "torch::CapturedTraceback",
        "torch::cuda::(anonymous namespace)::gather",
        "c10::",
        "at::detail::empty",
        "at::empty",
        "at::native::empty",
        "at::_ops::empty",
        "at::(anonymous namespace)",
        "at::_ops::",
    ];
    PREFIXES.iter().any(|p| n.starts_with(p)) || n.is_empty()
}

/// The frame a user wants as the call site (see the module documentation); `None` for an empty
/// stack.
pub fn call_site_frame(frames: &[Frame]) -> Option<&Frame> {
    frames
        .iter()
        .find(|f| kind(f) == FrameKind::User)
        .or_else(|| frames.iter().find(|f| kind(f) == FrameKind::Torch))
        .or_else(|| frames.iter().find(|f| kind(f) == FrameKind::Native && f.name.contains("::") && !is_plumbing(f)))
        .or_else(|| frames.first())
}

/// One frame as text: `file:line in name` for Python (an installed package's file from the
/// package on: `transformers/models/llama/modeling_llama.py`), the function name alone for a
/// native frame whose file is unknown (`??`, empty), `name (file)` otherwise.
pub fn frame_text(f: &Frame) -> String {
    match kind(f) {
        FrameKind::Native if f.filename.is_empty() || f.filename == "??" => f.name.clone(),
        FrameKind::Native if f.line <= 0 => format!("{} ({})", f.name, f.filename),
        _ => format!("{}:{} in {}", short_path(&f.filename), f.line, f.name),
    }
}

/// A file in an installed package, from the package on; any other path as it is.
fn short_path(filename: &str) -> &str {
    ["site-packages/", "dist-packages/"].iter().filter_map(|m| filename.rfind(m).map(|i| &filename[i + m.len()..])).next().unwrap_or(filename)
}

/// The call site of a stack as text (see [`call_site_frame`]).
pub fn call_site(frames: &[Frame]) -> Option<String> {
    call_site_frame(frames).map(frame_text)
}

/// The Python frames of a stack (innermost first): what `explain` and the report show of it.
pub fn python_frames(frames: &[Frame]) -> impl Iterator<Item = &Frame> {
    frames.iter().filter(|f| matches!(kind(f), FrameKind::User | FrameKind::Torch))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fr(name: &str, filename: &str, line: i64) -> Frame {
        Frame { name: name.into(), filename: filename.into(), line }
    }

    #[test]
    fn kinds() {
        assert_eq!(kind(&fr("torch::unwind::unwind()", "??", 0)), FrameKind::Native);
        assert_eq!(
            kind(&fr("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)", "CUDACachingAllocator.cpp", 0)),
            FrameKind::Native
        );
        assert_eq!(kind(&fr("_PyEval_EvalFrameDefault", "??", 0)), FrameKind::Native);
        assert_eq!(kind(&fr("forward", "/opt/venv/lib/python3.12/site-packages/torch/nn/modules/linear.py", 125)), FrameKind::Torch);
        assert_eq!(kind(&fr("backward", "/usr/lib/python3/dist-packages/torch/_tensor.py", 626)), FrameKind::Torch);
        assert_eq!(kind(&fr("forward", "/home/me/pytorch/torch/autograd/function.py", 1)), FrameKind::Torch);
        assert_eq!(kind(&fr("x", "torch/utils/checkpoint.py", 1)), FrameKind::Torch);
        // A user's own directory named torch is not PyTorch.
        assert_eq!(kind(&fr("main", "/opt/torch/train.py", 10)), FrameKind::User);
        assert_eq!(kind(&fr("main", "/home/me/torch/experiments/run.py", 10)), FrameKind::User);
        assert_eq!(kind(&fr("forward", "/opt/venv/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py", 1)), FrameKind::User);
        assert_eq!(kind(&fr("<module>", "<ipython-input-3-1a2b>", 1)), FrameKind::User);
        assert_eq!(kind(&fr("_call_with_frames_removed", "<frozen importlib._bootstrap>", 241)), FrameKind::PythonInternal);
        assert_eq!(kind(&fr("forward", "<eval_with_key>.3", 7)), FrameKind::PythonInternal);
    }

    #[test]
    fn call_site_skips_cpp_and_torch() {
        let stack = vec![
            fr("torch::unwind::unwind()", "??", 0),
            fr("torch::CapturedTraceback::gather(bool, bool, bool)", "??", 0),
            fr("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)", "CUDACachingAllocator.cpp", 0),
            fr("at::native::empty_cuda(c10::ArrayRef<long>)", "??", 0),
            fr("_PyEval_EvalFrameDefault", "??", 0),
            fr("_call_impl", "/venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1784),
            fr("forward", "/work/train.py", 42),
            fr("main", "/work/train.py", 90),
        ];
        assert_eq!(call_site(&stack).unwrap(), "/work/train.py:42 in forward");
        // Only PyTorch's Python frames: the first of them.
        assert_eq!(call_site(&stack[..6]).unwrap(), "torch/nn/modules/module.py:1784 in _call_impl");
        // Nothing but plumbing: the first frame.
        assert_eq!(call_site(&stack[..5]).unwrap(), "torch::unwind::unwind()");
        // Only C++ frames (`stacks="cpp"`): the first operation, not the plumbing.
        let cpp = vec![
            stack[0].clone(),
            stack[2].clone(),
            stack[3].clone(),
            fr("at::_ops::_to_copy::call(at::Tensor const&)", "??", 0),
            fr("at::native::_to_copy(at::Tensor const&)", "??", 0),
            fr("torch::autograd::THPVariable_cuda(_object*, _object*, _object*)", "python_variable_methods.cpp", 0),
            stack[4].clone(),
        ];
        assert_eq!(call_site(&cpp).unwrap(), "at::native::_to_copy(at::Tensor const&)");
        assert_eq!(frame_text(&cpp[5]), "torch::autograd::THPVariable_cuda(_object*, _object*, _object*) (python_variable_methods.cpp)");
        assert_eq!(call_site(&[]), None);
        assert_eq!(python_frames(&stack).count(), 3);
    }
}
