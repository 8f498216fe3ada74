//! Where commands write. A command writes its answer to [`Io::out`] and notes (files written,
//! fallbacks) to [`Io::err`], both any [`Write`]: the binary gives it stdout and stderr, a caller of
//! [`crate::cli::run`] any buffer.
//!
//! A closed pipe is not an error: `allocsim replay X --json | head` ends when `head` has read its
//! lines. [`PipeWriter`] drops everything written after the reader has gone, so the command
//! finishes what it computes and exits with the status it would have had (0, or 1 for `validate`
//! when the replay is not exact), with no error line and no panic.

use std::io::{self, ErrorKind, Write};

/// A command's two output streams.
pub struct Io<'a> {
    /// The answer (stdout).
    pub out: &'a mut dyn Write,
    /// Notes about the run (stderr): files written, fallbacks taken.
    pub err: &'a mut dyn Write,
}

/// A writer that treats a closed pipe (`EPIPE`) as the reader having read enough: from then on
/// every write succeeds and goes nowhere. Every other error is returned.
pub struct PipeWriter<W> {
    inner: W,
    closed: bool,
}

impl<W: Write> PipeWriter<W> {
    pub fn new(inner: W) -> Self {
        PipeWriter { inner, closed: false }
    }

    /// Whether the reader has closed the pipe.
    pub fn closed(&self) -> bool {
        self.closed
    }

    fn absorb(&mut self, r: io::Result<()>) -> io::Result<()> {
        match r {
            Err(e) if e.kind() == ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(())
            }
            r => r,
        }
    }
}

impl<W: Write> Write for PipeWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.closed {
            return Ok(buf.len());
        }
        match self.inner.write(buf) {
            Err(e) if e.kind() == ErrorKind::BrokenPipe => {
                self.closed = true;
                Ok(buf.len())
            }
            r => r,
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        if self.closed {
            return Ok(());
        }
        let r = self.inner.write_all(buf);
        self.absorb(r)
    }

    fn flush(&mut self) -> io::Result<()> {
        if self.closed {
            return Ok(());
        }
        let r = self.inner.flush();
        self.absorb(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Accepts `room` bytes, then fails as a closed pipe (or as a full disk).
    struct Reader {
        room: usize,
        kind: ErrorKind,
        got: Vec<u8>,
    }

    impl Write for Reader {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.got.len() >= self.room {
                return Err(io::Error::from(self.kind));
            }
            let n = buf.len().min(self.room - self.got.len());
            self.got.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn closed_pipe_drops_the_rest() {
        let mut w = PipeWriter::new(Reader { room: 10, kind: ErrorKind::BrokenPipe, got: vec![] });
        for i in 0..100 {
            writeln!(w, "line {i}").expect("a closed pipe is not an error");
        }
        w.flush().unwrap();
        assert!(w.closed());
        assert_eq!(w.inner.got, b"line 0\nlin");
    }

    #[test]
    fn other_errors_are_returned() {
        let mut w = PipeWriter::new(Reader { room: 4, kind: ErrorKind::StorageFull, got: vec![] });
        let e = writeln!(w, "longer than four bytes").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::StorageFull);
        assert!(!w.closed());
    }
}
