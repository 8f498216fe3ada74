//! A small safe layer over the CUDA driver calls allocsim needs: a context, `cuMemAlloc`'d memory, and
//! the virtual-memory trio of expandable segments (a reservation of addresses, a physical handle, a
//! mapping of one handle into a reservation). Every `unsafe` of this crate is in this module.
//!
//! Each object owns what it names and gives it back on drop (best effort, errors ignored); the
//! explicit `free`/`release`/`unmap` methods report errors instead. Each holds the context alive,
//! and a [`Mapping`] holds its [`Reservation`] alive, so a reservation cannot be released while
//! anything is mapped in it ([`Reservation::release`] refuses).
//!
//! cudarc is built with `dynamic-loading`: `libcuda.so` is opened at run time, and cudarc panics if
//! it is missing. [`Context::new`] checks for it first and returns [`CudaError::NoDriver`].

use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError, sys};

/// An error from the driver, or no driver at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver found (libcuda.so could not be loaded)")]
    NoDriver,
    #[error("{call}: out of memory")]
    OutOfMemory { call: &'static str },
    #[error("{call} failed: {name} ({code})")]
    Driver { call: &'static str, name: String, code: u32 },
    #[error("{0}")]
    Usage(String),
}

fn check(call: &'static str, r: sys::CUresult) -> Result<(), CudaError> {
    r.result().map_err(|e| driver_error(call, e))
}

fn driver_error(call: &'static str, e: DriverError) -> CudaError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return CudaError::OutOfMemory { call };
    }
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    CudaError::Driver { call, name, code: e.0 as u32 }
}

/// Whether `libcuda.so` can be loaded (without it every driver call would panic).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names and drops it again.
    unsafe { sys::is_culib_present() }
}

/// The primary context of one device, bound to the creating thread.
#[derive(Clone)]
pub struct Context {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context").field("ordinal", &self.ctx.ordinal()).finish()
    }
}

impl Context {
    /// `cuInit`, then the primary context of device `ordinal`, made current on this thread.
    pub fn new(ordinal: usize) -> Result<Context, CudaError> {
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_error("cuInit/cuDevicePrimaryCtxRetain", e))?;
        Ok(Context { ctx })
    }

    /// Makes the context current on this thread (needed before driver calls on another thread).
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    pub fn name(&self) -> Result<String, CudaError> {
        self.ctx.name().map_err(|e| driver_error("cuDeviceGetName", e))
    }

    /// `cuDriverGetVersion` (e.g. 13000).
    pub fn driver_version(&self) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: writes one int.
        check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) })?;
        Ok(v)
    }

    /// `cuMemGetInfo`: (free, total) bytes.
    pub fn mem_get_info(&self) -> Result<(u64, u64), CudaError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t; the context is current on this thread.
        check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        Ok((free as u64, total as u64))
    }

    fn allocation_prop(&self) -> sys::CUmemAllocationProp {
        // SAFETY: a plain C struct; all-zero is its documented default.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = self.ctx.cu_device();
        prop
    }

    /// `cuMemGetAllocationGranularity` (minimum) of plain device memory: the page unit of `cuMemCreate`.
    pub fn granularity(&self) -> Result<u64, CudaError> {
        let prop = self.allocation_prop();
        let mut g = 0usize;
        // SAFETY: reads `prop`, writes one size_t.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(&mut g, &prop, sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        })?;
        Ok(g as u64)
    }
}

/// Device memory from `cuMemAlloc` (what `cudaMalloc` does); `cuMemFree` on drop.
#[derive(Debug)]
pub struct DeviceMemory {
    ctx: Context,
    ptr: u64,
    size: u64,
    live: bool,
}

impl DeviceMemory {
    pub fn alloc(ctx: &Context, size: u64) -> Result<DeviceMemory, CudaError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: writes one pointer; the context is current on this thread.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, size as usize) })?;
        Ok(DeviceMemory { ctx: ctx.clone(), ptr, size, live: true })
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    /// `cuMemFree`.
    pub fn free(mut self) -> Result<(), CudaError> {
        self.live = false;
        // SAFETY: `ptr` came from cuMemAlloc and is freed once (`live` is cleared first).
        check("cuMemFree", unsafe { sys::cuMemFree_v2(self.ptr) })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.live {
            let _ = self.ctx.bind();
            // SAFETY: as in `free`.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// A range of device virtual addresses from `cuMemAddressReserve`; `cuMemAddressFree` on drop.
#[derive(Debug)]
pub struct Reservation {
    ctx: Context,
    base: u64,
    size: u64,
    live: bool,
}

impl Reservation {
    /// `cuMemAddressReserve(size, alignment 0, no fixed address)`, as PyTorch's `ExpandableSegment` does.
    pub fn new(ctx: &Context, size: u64) -> Result<Arc<Reservation>, CudaError> {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one pointer.
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut base, size as usize, 0, 0, 0) })?;
        Ok(Arc::new(Reservation { ctx: ctx.clone(), base, size, live: true }))
    }
    pub fn base(&self) -> u64 {
        self.base
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    /// `cuMemSetAccess` (read/write from this device) over `[offset, offset + size)`, all mapped.
    pub fn set_access(&self, offset: u64, size: u64) -> Result<(), CudaError> {
        if offset.checked_add(size).is_none_or(|e| e > self.size) {
            return Err(CudaError::Usage(format!("set_access beyond the reservation ({offset:#x} + {size:#x})")));
        }
        let desc = sys::CUmemAccessDesc { location: self.ctx.allocation_prop().location, flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE };
        // SAFETY: the range lies in our reservation; reads one descriptor.
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(self.base + offset, size as usize, &desc, 1) })
    }
    /// `cuMemAddressFree`. Refused while a [`Mapping`] still holds the reservation.
    pub fn release(this: Arc<Reservation>) -> Result<(), CudaError> {
        match Arc::try_unwrap(this) {
            Ok(mut r) => {
                r.live = false;
                // SAFETY: the reservation is ours alone (no mapping holds it), freed once (`live`).
                check("cuMemAddressFree", unsafe { sys::cuMemAddressFree(r.base, r.size as usize) })
            }
            Err(_) => Err(CudaError::Usage("cuMemAddressFree of a reservation that still has mappings".into())),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.live {
            let _ = self.ctx.bind();
            // SAFETY: our reservation; no mapping holds it (mappings hold an Arc to it).
            let _ = unsafe { sys::cuMemAddressFree(self.base, self.size as usize) };
        }
    }
}

/// Physical device memory from `cuMemCreate`; `cuMemRelease` on drop.
#[derive(Debug)]
pub struct PhysicalHandle {
    ctx: Context,
    handle: sys::CUmemGenericAllocationHandle,
    size: u64,
    live: bool,
}

impl PhysicalHandle {
    /// `cuMemCreate` of `size` bytes (a multiple of [`Context::granularity`]) of plain device memory.
    pub fn create(ctx: &Context, size: u64) -> Result<PhysicalHandle, CudaError> {
        let prop = ctx.allocation_prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: reads `prop`, writes one handle.
        check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, size as usize, &prop, 0) })?;
        Ok(PhysicalHandle { ctx: ctx.clone(), handle, size, live: true })
    }
    pub fn size(&self) -> u64 {
        self.size
    }
    /// `cuMemRelease`.
    pub fn release(mut self) -> Result<(), CudaError> {
        self.live = false;
        // SAFETY: our handle, released once.
        check("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) })
    }
}

impl Drop for PhysicalHandle {
    fn drop(&mut self) {
        if self.live {
            let _ = self.ctx.bind();
            // SAFETY: as in `release`.
            let _ = unsafe { sys::cuMemRelease(self.handle) };
        }
    }
}

/// One physical handle mapped at an offset of a reservation (`cuMemMap`); `cuMemUnmap` then
/// `cuMemRelease` on drop.
#[derive(Debug)]
pub struct Mapping {
    reservation: Arc<Reservation>,
    offset: u64,
    handle: Option<PhysicalHandle>,
}

impl Mapping {
    /// `cuMemMap` of the whole of `handle` at `offset` in `reservation`. On failure the handle comes
    /// back with the error.
    pub fn map(reservation: &Arc<Reservation>, offset: u64, handle: PhysicalHandle) -> Result<Mapping, (CudaError, PhysicalHandle)> {
        if offset.checked_add(handle.size).is_none_or(|e| e > reservation.size) {
            return Err((CudaError::Usage(format!("cuMemMap beyond the reservation ({offset:#x} + {:#x})", handle.size)), handle));
        }
        // SAFETY: the range lies in our reservation; the handle stays alive as long as the mapping.
        let r = unsafe { sys::cuMemMap(reservation.base + offset, handle.size as usize, 0, handle.handle, 0) };
        match check("cuMemMap", r) {
            Ok(()) => Ok(Mapping { reservation: reservation.clone(), offset, handle: Some(handle) }),
            Err(e) => Err((e, handle)),
        }
    }
    pub fn ptr(&self) -> u64 {
        self.reservation.base + self.offset
    }
    pub fn size(&self) -> u64 {
        self.handle.as_ref().map_or(0, |h| h.size)
    }
    /// `cuMemUnmap`; the physical handle comes back, still to be released.
    pub fn unmap(mut self) -> Result<PhysicalHandle, CudaError> {
        let h = self.handle.take().expect("a live mapping has its handle");
        // SAFETY: our mapping, unmapped once (the handle is taken, so Drop does nothing).
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(self.reservation.base + self.offset, h.size as usize) })?;
        Ok(h)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            let _ = self.reservation.ctx.bind();
            // SAFETY: as in `unmap`; then the handle drops (cuMemRelease).
            let _ = unsafe { sys::cuMemUnmap(self.reservation.base + self.offset, h.size as usize) };
        }
    }
}
