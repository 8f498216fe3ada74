//! [`CudaDevice`]: the model's [`Device`] on a real GPU, with the time of every driver call.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use allocsim_model::Device;
use allocsim_model::constants::K_SMALL_BUFFER;

use crate::driver::{Context, CudaError, DeviceMemory, Mapping, PhysicalHandle, Reservation};

/// Count and total time of one kind of device call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Timing {
    pub count: u64,
    pub total_ns: u64,
}

impl Timing {
    pub fn mean_us(&self) -> f64 {
        if self.count == 0 { 0.0 } else { self.total_ns as f64 / self.count as f64 / 1000.0 }
    }
}

/// The kinds of call timed. The first six are the model's [`Device`] calls, each whole (a `map` of
/// n pages is n `cuMemCreate`, n `cuMemMap` and one `cuMemSetAccess`); the rest are the driver
/// calls inside them.
pub const CALL_KINDS: &[&str] = &[
    "cudaMalloc",
    "cudaFree",
    "map",
    "unmap",
    "reserve",
    "release_reservation",
    "cuMemCreate",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuMemRelease",
    "cuMemGetInfo",
];

#[derive(Debug)]
struct ReservationEntry {
    res: Arc<Reservation>,
    /// The expandable segment's page (`segment_size`): 2 MiB (small pool) or `large_segment_size`.
    page: u64,
}

/// A real GPU behind the allocator model: `malloc`/`free` are `cuMemAlloc`/`cuMemFree`, an
/// expandable segment is a `cuMemAddressReserve`d range whose pages are `cuMemCreate`d and
/// `cuMemMap`ped one handle per page (as PyTorch's `ExpandableSegment::map` does), and
/// `mem_get_info` is `cuMemGetInfo`.
///
/// * `cap`: the device refuses (`None`/`false`) whatever would take the bytes it has handed out past
///   the cap, so a replay under `--capacity` cannot take more of the GPU than the fraction allows
///   even if the model were wrong (the model checks the fraction itself). [`crate::device_cap`]
///   gives the cap for a replay: the allowed maximum plus, with expandable segments, one page
///   (PyTorch checks the request against the maximum, then maps whole pages, so reserved memory can
///   pass the maximum by less than a page). A refusal by the cap is counted
///   ([`CudaDevice::cap_refusals`]).
/// * Every call is timed ([`CudaDevice::timings`]).
/// * A driver error other than out-of-memory is recorded ([`CudaDevice::errors`]) and the call
///   reports failure; it never panics.
///
/// The device does not synchronize before unmapping (PyTorch does; nothing runs on the GPU here).
#[derive(Debug)]
pub struct CudaDevice {
    // Field order is drop order: mappings before the reservations they live in.
    mappings: BTreeMap<u64, Mapping>,
    reservations: BTreeMap<u64, ReservationEntry>,
    allocations: HashMap<u64, DeviceMemory>,
    ctx: Context,
    total: u64,
    granularity: u64,
    large_segment_size: u64,
    cap: Option<u64>,
    /// Bytes handed out: cuMemAlloc'd plus mapped.
    in_use: u64,
    /// Calls refused because of the cap (not by the driver).
    cap_refusals: u64,
    timings: RefCell<BTreeMap<&'static str, Timing>>,
    errors: RefCell<Vec<String>>,
}

impl CudaDevice {
    /// The primary context of GPU `ordinal`. Without a driver: [`CudaError::NoDriver`], never a panic.
    pub fn new(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let ctx = Context::new(ordinal)?;
        let (_, total) = ctx.mem_get_info()?;
        let granularity = ctx.granularity()?;
        Ok(CudaDevice {
            mappings: BTreeMap::new(),
            reservations: BTreeMap::new(),
            allocations: HashMap::new(),
            ctx,
            total,
            granularity,
            large_segment_size: allocsim_model::constants::K_LARGE_BUFFER,
            cap: None,
            in_use: 0,
            cap_refusals: 0,
            timings: RefCell::new(BTreeMap::new()),
            errors: RefCell::new(Vec::new()),
        })
    }

    /// Refuse allocations that would take more than `cap` bytes in all.
    pub fn with_cap(mut self, cap: Option<u64>) -> CudaDevice {
        self.cap = cap;
        self
    }

    /// The `large_segment_size` of the config replayed: the page of large-pool expandable segments.
    pub fn with_large_segment_size(mut self, bytes: u64) -> CudaDevice {
        self.large_segment_size = bytes;
        self
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }
    pub fn total(&self) -> u64 {
        self.total
    }
    /// `cuMemCreate`'s granularity (2 MiB on an H200).
    pub fn granularity(&self) -> u64 {
        self.granularity
    }
    /// Bytes currently handed out (cuMemAlloc'd plus mapped).
    pub fn in_use(&self) -> u64 {
        self.in_use
    }
    /// Calls refused because of the cap: the model asked for more than the cap allows, so the
    /// replay no longer follows the model's own decisions.
    pub fn cap_refusals(&self) -> u64 {
        self.cap_refusals
    }
    /// Per call kind: count and total time.
    pub fn timings(&self) -> BTreeMap<&'static str, Timing> {
        self.timings.borrow().clone()
    }
    /// Driver errors other than out-of-memory, in order.
    pub fn errors(&self) -> Vec<String> {
        self.errors.borrow().clone()
    }

    /// `cuMemGetInfo`, timed; `None` (and an error recorded) if it fails.
    pub fn try_mem_get_info(&self) -> Option<(u64, u64)> {
        match self.timed("cuMemGetInfo", || self.ctx.mem_get_info()) {
            Ok(v) => Some(v),
            Err(e) => {
                self.error(e);
                None
            }
        }
    }

    /// Frees everything still allocated, mapped or reserved (as the allocator's destructor would
    /// not: PyTorch keeps its cache until the process ends). Returns the driver errors it met.
    pub fn release_all(&mut self) -> Vec<CudaError> {
        let mut errs = Vec::new();
        let _ = self.ctx.bind();
        for (_, m) in std::mem::take(&mut self.mappings) {
            match m.unmap() {
                Ok(h) => errs.extend(h.release().err()),
                Err(e) => errs.push(e),
            }
        }
        for (_, r) in std::mem::take(&mut self.reservations) {
            errs.extend(Reservation::release(r.res).err());
        }
        for (_, a) in std::mem::take(&mut self.allocations) {
            errs.extend(a.free().err());
        }
        self.in_use = 0;
        errs
    }

    fn timed<T>(&self, kind: &'static str, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        let ns = t.elapsed().as_nanos() as u64;
        let mut tm = self.timings.borrow_mut();
        let e = tm.entry(kind).or_default();
        e.count += 1;
        e.total_ns += ns;
        r
    }

    fn error(&self, e: CudaError) {
        self.errors.borrow_mut().push(e.to_string());
    }

    /// Whether `size` more bytes stay within the cap.
    fn fits(&self, size: u64) -> bool {
        self.cap.is_none_or(|c| self.in_use.saturating_add(size) <= c)
    }

    /// The page size of a new reservation of `size` bytes. The model reserves
    /// `ceil(1.125 × total / page) × page` bytes (PyTorch's `max_handles × segment_size`) with the
    /// page 2 MiB in the small pool and `large_segment_size` in the large one; where both give the
    /// same size, `cuMemCreate`'s granularity is used (the bytes mapped are the same either way).
    fn page_of_reservation(&self, size: u64) -> u64 {
        let t = self.total + self.total / 8;
        let fits = |p: u64| p > 0 && size.is_multiple_of(p) && size / p == t.div_ceil(p);
        match (fits(self.large_segment_size), fits(K_SMALL_BUFFER)) {
            (true, false) => self.large_segment_size,
            (false, true) => K_SMALL_BUFFER,
            _ => self.granularity,
        }
    }

    /// The reservation holding `[ptr, ptr + size)`.
    fn reservation_at(&self, ptr: u64, size: u64) -> Option<(u64, &ReservationEntry)> {
        let (&base, r) = self.reservations.range(..=ptr).next_back()?;
        (ptr + size <= base + r.res.size()).then_some((base, r))
    }

    fn do_map(&mut self, ptr: u64, size: u64) -> Result<(), CudaError> {
        let (base, entry) = self.reservation_at(ptr, size).ok_or_else(|| CudaError::Usage(format!("map of {size:#x} at {ptr:#x}: no reservation holds it")))?;
        let (res, page) = (entry.res.clone(), entry.page);
        if size == 0 || !size.is_multiple_of(page) || !(ptr - base).is_multiple_of(page) {
            return Err(CudaError::Usage(format!("map of {size:#x} at {ptr:#x}: not whole pages of {page:#x}")));
        }
        let n = size / page;
        // PyTorch's ExpandableSegment::map: create every handle first (on failure, release those made),
        // then map each, then set access over the whole range.
        let mut handles = Vec::with_capacity(n as usize);
        for _ in 0..n {
            match self.timed("cuMemCreate", || PhysicalHandle::create(&self.ctx, page)) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    for h in handles {
                        self.timed("cuMemRelease", || h.release()).ok();
                    }
                    return Err(e);
                }
            }
        }
        let mut mapped = Vec::with_capacity(n as usize);
        for (i, h) in handles.into_iter().enumerate() {
            let off = ptr - base + i as u64 * page;
            match self.timed("cuMemMap", || Mapping::map(&res, off, h)) {
                Ok(m) => mapped.push(m),
                Err((e, h)) => {
                    drop(h);
                    drop(mapped);
                    return Err(e);
                }
            }
        }
        if let Err(e) = self.timed("cuMemSetAccess", || res.set_access(ptr - base, size)) {
            drop(mapped);
            return Err(e);
        }
        for m in mapped {
            self.mappings.insert(m.ptr(), m);
        }
        Ok(())
    }

    fn do_unmap(&mut self, ptr: u64, size: u64) -> Result<(), CudaError> {
        let mut p = ptr;
        while p < ptr + size {
            let m = self.mappings.remove(&p).ok_or_else(|| CudaError::Usage(format!("unmap at {p:#x}: nothing mapped there")))?;
            let len = m.size();
            let h = self.timed("cuMemUnmap", || m.unmap())?;
            self.timed("cuMemRelease", || h.release())?;
            p += len;
        }
        if p != ptr + size {
            return Err(CudaError::Usage(format!("unmap of {size:#x} at {ptr:#x} ends inside a page")));
        }
        Ok(())
    }
}

impl Device for CudaDevice {
    fn malloc(&mut self, size: u64) -> Option<u64> {
        if !self.fits(size) {
            self.cap_refusals += 1;
            return None;
        }
        let r = self.timed("cudaMalloc", || DeviceMemory::alloc(&self.ctx, size));
        match r {
            Ok(m) => {
                let ptr = m.ptr();
                self.allocations.insert(ptr, m);
                self.in_use += size;
                Some(ptr)
            }
            Err(CudaError::OutOfMemory { .. }) => None,
            Err(e) => {
                self.error(e);
                None
            }
        }
    }

    fn free(&mut self, ptr: u64, size: u64) {
        let Some(m) = self.allocations.remove(&ptr) else {
            self.error(CudaError::Usage(format!("cudaFree of {ptr:#x}: not allocated")));
            return;
        };
        if m.size() != size {
            self.error(CudaError::Usage(format!("cudaFree of {ptr:#x}: {size} bytes, but {} were allocated", m.size())));
        }
        self.in_use -= m.size();
        if let Err(e) = self.timed("cudaFree", || m.free()) {
            self.error(e);
        }
    }

    fn reserve(&mut self, size: u64) -> u64 {
        let page = self.page_of_reservation(size);
        match self.timed("reserve", || Reservation::new(&self.ctx, size)) {
            Ok(res) => {
                let base = res.base();
                self.reservations.insert(base, ReservationEntry { res, page });
                base
            }
            Err(e) => {
                // The trait has no failure here; address 0 is in no reservation, so every map fails.
                self.error(e);
                0
            }
        }
    }

    fn release_reservation(&mut self, base: u64, size: u64) {
        let Some(r) = self.reservations.remove(&base) else {
            self.error(CudaError::Usage(format!("cuMemAddressFree of {base:#x}: not reserved")));
            return;
        };
        if r.res.size() != size {
            self.error(CudaError::Usage(format!("cuMemAddressFree of {base:#x}: {size} bytes, but {} were reserved", r.res.size())));
        }
        if let Err(e) = self.timed("release_reservation", || Reservation::release(r.res)) {
            self.error(e);
        }
    }

    fn map(&mut self, ptr: u64, size: u64) -> bool {
        if !self.fits(size) {
            self.cap_refusals += 1;
            return false;
        }
        let t = Instant::now();
        let r = self.do_map(ptr, size);
        self.record("map", t);
        match r {
            Ok(()) => {
                self.in_use += size;
                true
            }
            Err(CudaError::OutOfMemory { .. }) => false,
            Err(e) => {
                self.error(e);
                false
            }
        }
    }

    fn unmap(&mut self, ptr: u64, size: u64) {
        let t = Instant::now();
        let r = self.do_unmap(ptr, size);
        self.record("unmap", t);
        self.in_use = self.in_use.saturating_sub(size);
        if let Err(e) = r {
            self.error(e);
        }
    }

    fn mem_get_info(&self) -> (u64, u64) {
        self.try_mem_get_info().unwrap_or((0, self.total))
    }
}

impl CudaDevice {
    fn record(&self, kind: &'static str, since: Instant) {
        let ns = since.elapsed().as_nanos() as u64;
        let mut tm = self.timings.borrow_mut();
        let e = tm.entry(kind).or_default();
        e.count += 1;
        e.total_ns += ns;
    }
}
