//! Device buffers with their base address, and bounds-checked pointers into them.
//!
//! Design: kernels take raw device pointers (plus element offsets computed on the
//! host), so one buffer can hold several tensors (the step metadata, stacked
//! projections) without typed sub-views. Every pointer handed to a launch comes from
//! [`DevBuf::span`], which checks that the whole region the kernel may touch lies inside
//! the allocation: that check is what each launch's SAFETY comment relies on.
//!
//! Invariants: `ptr` is the base address of `slice` for its whole life (cudarc never
//! moves an allocation); `len` is its element count; the owner keeps the buffer alive
//! until the stream has finished every kernel that uses it (buffers live as long as the
//! backend, and are only replaced between steps, after a synchronizing copy-out).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};

use crate::error::{CudaError, Result};

/// A device allocation of `len` elements of `T`.
pub struct DevBuf<T> {
    /// Shape: [len].
    pub slice: CudaSlice<T>,
    /// Base device address.
    pub ptr: u64,
    pub len: usize,
}

impl<T: DeviceRepr> DevBuf<T> {
    fn wrap(slice: CudaSlice<T>, stream: &Arc<CudaStream>) -> Self {
        let len = slice.len();
        let ptr = {
            let (p, _sync) = slice.device_ptr(stream);
            p
        };
        Self { slice, ptr, len }
    }

    /// Upload a host slice.
    pub fn upload(stream: &Arc<CudaStream>, v: &[T], what: &str) -> Result<Self> {
        let s = stream
            .clone_htod(v)
            .map_err(|e| CudaError::driver(format!("upload {what}"), e))?;
        Ok(Self::wrap(s, stream))
    }

    /// Copy a host slice into the start of this buffer (no allocation).
    pub fn write(&mut self, stream: &Arc<CudaStream>, v: &[T], what: &str) -> Result<()> {
        if v.len() > self.len {
            return Err(CudaError::Input(format!(
                "{what}: {} elements into a buffer of {}",
                v.len(),
                self.len
            )));
        }
        let mut dst = self.slice.slice_mut(0..v.len());
        stream
            .memcpy_htod(v, &mut dst)
            .map_err(|e| CudaError::driver(format!("copy {what} to the device"), e))
    }

    /// Copy elements `[off, off + n)` to the host (synchronizes the stream).
    pub fn read(&self, stream: &Arc<CudaStream>, off: usize, n: usize, what: &str) -> Result<Vec<T>>
    where
        T: Default + Clone,
    {
        if off + n > self.len {
            return Err(CudaError::Input(format!(
                "{what}: read [{off}, {}) of a buffer of {}",
                off + n,
                self.len
            )));
        }
        let mut out = vec![T::default(); n];
        stream
            .memcpy_dtoh(&self.slice.slice(off..off + n), &mut out)
            .map_err(|e| CudaError::driver(format!("copy {what} to the host"), e))?;
        // A device-to-pageable copy completes before returning in practice; the explicit
        // sync makes `out` valid whatever the driver does.
        stream
            .synchronize()
            .map_err(|e| CudaError::driver(format!("synchronize after reading {what}"), e))?;
        Ok(out)
    }

    /// Address of element `off`, after checking `[off, off + n)` lies in the buffer.
    pub fn span(&self, off: usize, n: usize, what: &str) -> Result<u64> {
        match off.checked_add(n) {
            Some(end) if end <= self.len => Ok(self.ptr + (off * std::mem::size_of::<T>()) as u64),
            _ => Err(CudaError::Input(format!(
                "{what}: region [{off}, {off} + {n}) outside a buffer of {} elements (internal)",
                self.len
            ))),
        }
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> DevBuf<T> {
    /// A zeroed buffer of `len` (at least 1) elements.
    pub fn zeros(stream: &Arc<CudaStream>, len: usize, what: &str) -> Result<Self> {
        let s = stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| CudaError::driver(format!("allocate {what} ({len} elements)"), e))?;
        Ok(Self::wrap(s, stream))
    }
}
