//! [`Measured`]: any [`Device`] with its used memory (`total − free` from `mem_get_info`) read
//! before and after every call, and [`check`], which holds those readings against the segment events
//! the model produced. Generic over the device, so the check itself is tested without a GPU.

use allocsim_model::Device;
use allocsim_replay::replay::SegmentEvent;

/// A device call that can move used memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Call {
    Malloc,
    Free,
    Map,
    Unmap,
    Reserve,
    ReleaseReservation,
}

impl Call {
    /// The segment event the model records for a successful call (none for reservations).
    pub fn action(self) -> Option<allocsim_trace::Action> {
        use allocsim_trace::Action;
        match self {
            Call::Malloc => Some(Action::SegmentAlloc),
            Call::Free => Some(Action::SegmentFree),
            Call::Map => Some(Action::SegmentMap),
            Call::Unmap => Some(Action::SegmentUnmap),
            Call::Reserve | Call::ReleaseReservation => None,
        }
    }
    /// How a successful call moves used memory, per byte of its size.
    fn sign(self) -> i64 {
        match self {
            Call::Malloc | Call::Map => 1,
            Call::Free | Call::Unmap => -1,
            Call::Reserve | Call::ReleaseReservation => 0,
        }
    }
}

/// One call and the device's used memory around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Measurement {
    pub call: Call,
    pub addr: u64,
    pub size: u64,
    /// The call succeeded (a refused malloc or map produces no segment event).
    pub ok: bool,
    pub used_before: u64,
    pub used_after: u64,
}

impl Measurement {
    pub fn delta(&self) -> i64 {
        self.used_after as i64 - self.used_before as i64
    }
}

/// A device whose every call is measured.
#[derive(Clone, Debug)]
pub struct Measured<D: Device> {
    pub inner: D,
    pub log: Vec<Measurement>,
}

impl<D: Device> Measured<D> {
    pub fn new(inner: D) -> Measured<D> {
        Measured { inner, log: Vec::new() }
    }
    fn used(&self) -> u64 {
        let (free, total) = self.inner.mem_get_info();
        total.saturating_sub(free)
    }
    fn measure<T>(&mut self, call: Call, addr: u64, size: u64, f: impl FnOnce(&mut D) -> T, ok: impl Fn(&T) -> bool) -> T {
        let used_before = self.used();
        let r = f(&mut self.inner);
        let used_after = self.used();
        self.log.push(Measurement { call, addr, size, ok: ok(&r), used_before, used_after });
        r
    }
}

impl<D: Device> Device for Measured<D> {
    fn malloc(&mut self, size: u64) -> Option<u64> {
        let used_before = self.used();
        let r = self.inner.malloc(size);
        let used_after = self.used();
        self.log.push(Measurement { call: Call::Malloc, addr: r.unwrap_or(0), size, ok: r.is_some(), used_before, used_after });
        r
    }
    fn free(&mut self, ptr: u64, size: u64) {
        self.measure(Call::Free, ptr, size, |d| d.free(ptr, size), |_| true)
    }
    fn reserve(&mut self, size: u64) -> u64 {
        let used_before = self.used();
        let base = self.inner.reserve(size);
        let used_after = self.used();
        self.log.push(Measurement { call: Call::Reserve, addr: base, size, ok: true, used_before, used_after });
        base
    }
    fn release_reservation(&mut self, base: u64, size: u64) {
        self.measure(Call::ReleaseReservation, base, size, |d| d.release_reservation(base, size), |_| true)
    }
    fn map(&mut self, ptr: u64, size: u64) -> bool {
        self.measure(Call::Map, ptr, size, |d| d.map(ptr, size), |&ok| ok)
    }
    fn unmap(&mut self, ptr: u64, size: u64) {
        self.measure(Call::Unmap, ptr, size, |d| d.unmap(ptr, size), |_| true)
    }
    fn mem_get_info(&self) -> (u64, u64) {
        self.inner.mem_get_info()
    }
    fn set_outside_memory(&mut self, bytes: u64) {
        self.inner.set_outside_memory(bytes)
    }
}

/// A segment event whose measured move of used memory differs from the model's reserved delta, or
/// a call that moved used memory where it should not have, or an event and a call that do not pair.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Mismatch {
    /// Index in the model's segment events (`None`: a failed call or a reservation call).
    pub event: Option<usize>,
    /// The request during which it happened.
    pub request: Option<u32>,
    pub action: String,
    pub addr: u64,
    pub size: u64,
    /// The model's reserved delta (signed bytes).
    pub expected_delta: i64,
    /// `total − free` after minus before.
    pub measured_delta: i64,
    pub note: String,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.event {
            Some(i) => write!(f, "event {i}")?,
            None => write!(f, "call")?,
        }
        if let Some(r) = self.request {
            write!(f, " (request {r})")?;
        }
        write!(
            f,
            ": {} of {} bytes at {:#x}: the model's reserved delta {:+}, the device's used memory moved {:+}",
            self.action, self.size, self.addr, self.expected_delta, self.measured_delta
        )?;
        if !self.note.is_empty() {
            write!(f, " ({})", self.note)?;
        }
        Ok(())
    }
}

/// What [`check`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// Segment events paired with a successful call and compared.
    pub events_checked: usize,
    /// Calls the device refused (out of memory or beyond its cap).
    pub refused_calls: usize,
    /// Reservation calls (used memory must not move).
    pub reservation_calls: usize,
    pub mismatches: Vec<Mismatch>,
}

/// Pairs the model's segment events with the successful calls in order and compares each measured
/// move of used memory with the event's size; refused calls and reservations must move nothing.
pub fn check(events: &[SegmentEvent], log: &[Measurement]) -> Check {
    let mut c = Check::default();
    let mut ev = events.iter().enumerate();
    for m in log {
        let Some(action) = m.call.action() else {
            c.reservation_calls += 1;
            if m.delta() != 0 {
                c.mismatches.push(Mismatch {
                    event: None,
                    request: None,
                    action: format!("{:?}", m.call).to_lowercase(),
                    addr: m.addr,
                    size: m.size,
                    expected_delta: 0,
                    measured_delta: m.delta(),
                    note: "address reservations take no memory".into(),
                });
            }
            continue;
        };
        if !m.ok {
            c.refused_calls += 1;
            if m.delta() != 0 {
                c.mismatches.push(Mismatch {
                    event: None,
                    request: None,
                    action: action.as_str().into(),
                    addr: m.addr,
                    size: m.size,
                    expected_delta: 0,
                    measured_delta: m.delta(),
                    note: "refused call moved used memory".into(),
                });
            }
            continue;
        }
        let expected = m.call.sign() * m.size as i64;
        match ev.next() {
            None => c.mismatches.push(Mismatch {
                event: None,
                request: None,
                action: action.as_str().into(),
                addr: m.addr,
                size: m.size,
                expected_delta: expected,
                measured_delta: m.delta(),
                note: "device call with no segment event in the model".into(),
            }),
            Some((i, e)) => {
                c.events_checked += 1;
                let paired = e.action == action && e.addr == m.addr && e.size == m.size;
                let delta = if e.action.reserves() { e.size as i64 } else { -(e.size as i64) };
                if !paired || m.delta() != delta {
                    c.mismatches.push(Mismatch {
                        event: Some(i),
                        request: Some(e.request),
                        action: e.action.as_str().into(),
                        addr: e.addr,
                        size: e.size,
                        expected_delta: delta,
                        measured_delta: m.delta(),
                        note: if paired { String::new() } else { format!("the device call was {action} of {} bytes at {:#x}", m.size, m.addr) },
                    });
                }
            }
        }
    }
    for (i, e) in ev {
        c.mismatches.push(Mismatch {
            event: Some(i),
            request: Some(e.request),
            action: e.action.as_str().into(),
            addr: e.addr,
            size: e.size,
            expected_delta: if e.action.reserves() { e.size as i64 } else { -(e.size as i64) },
            measured_delta: 0,
            note: "segment event with no device call".into(),
        });
    }
    c
}
