//! What the caller of an `operator delete`, or of C23's `free_sized` and
//! `free_aligned_sized`, says of the block it gives back.
//!
//! C++14's sized deallocation passes the size of the object's type (`delete p` of a `Derived`
//! through a `Base*` whose destructor is not virtual passes `sizeof(Base)`), and C++17's
//! aligned `new` has an aligned `delete` that passes the alignment. A release that disagrees
//! with its allocation is undefined behaviour that AddressSanitizer reports as
//! new-delete-type-mismatch; the guard does too. The release path carries only the pointer
//! through the spy's methods, so the export's spied path notes the rest here, in the
//! thread's state, for the block it releases and for the length of its call. Every form
//! notes: the plain ones say the block is default-aligned, and a block found without a note
//! (a `delete` parked for a later hook) is not checked.

use core::ffi::c_void;

use crate::tls;

/// Not said (the unsized or unaligned forms, and every other release).
const UNSAID: usize = usize::MAX;

/// The size and alignment a `delete` (or a sized free) of one block was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeleteHint {
    /// The size of the object's type (or, for `delete[]`, of the whole array with its cookie);
    /// a size of 0 is taken as not said, as AddressSanitizer takes it.
    pub size: Option<usize>,
    /// The alignment the block was allocated with (`None`: default-aligned).
    pub align: Option<usize>,
}

impl DeleteHint {
    /// What the release in progress on this thread said of `ptr`, when it is an `operator
    /// delete` of that very block (a free parked for later, which a later hook finishes, or a
    /// signal handler's, is another block's release).
    pub(crate) fn of(ptr: *mut c_void) -> Option<DeleteHint> {
        let ts = tls::state();
        if ts.delete_ptr.get() != ptr as usize || ptr.is_null() {
            return None;
        }
        let said = |v: usize| (v != UNSAID).then_some(v);
        let size = said(ts.delete_size.get()).filter(|&size| size != 0);
        Some(DeleteHint { size, align: said(ts.delete_align.get()) })
    }
}

/// Notes what a `delete` of `ptr` said (`None`: not said) while `release` runs, then puts back
/// what was noted before: a signal handler's `delete` may have interrupted another's.
#[inline]
pub(crate) fn while_told<R>(
    ptr: *mut c_void,
    size: Option<usize>,
    align: Option<usize>,
    release: impl FnOnce() -> R,
) -> R {
    let ts = tls::state();
    let before = (ts.delete_ptr.get(), ts.delete_size.get(), ts.delete_align.get());
    ts.delete_size.set(size.unwrap_or(UNSAID));
    ts.delete_align.set(align.unwrap_or(UNSAID));
    ts.delete_ptr.set(ptr as usize);
    let result = release();
    ts.delete_ptr.set(before.0);
    ts.delete_size.set(before.1);
    ts.delete_align.set(before.2);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hint_is_its_blocks_alone_for_the_length_of_its_release() {
        let (a, b) = (0x1000 as *mut c_void, 0x2000 as *mut c_void);
        assert_eq!(DeleteHint::of(a), None);
        let inner = while_told(a, Some(64), Some(128), || {
            let outer = DeleteHint::of(a);
            // A handler's delete of another block, inside this one's release.
            let nested = while_told(b, Some(0), None, || (DeleteHint::of(b), DeleteHint::of(a)));
            (outer, nested, DeleteHint::of(a))
        });
        let told = DeleteHint { size: Some(64), align: Some(128) };
        // A size of 0 is taken as not said, as AddressSanitizer takes it.
        assert_eq!(inner, (Some(told), (Some(DeleteHint { size: None, align: None }), None), Some(told)));
        assert_eq!((DeleteHint::of(a), DeleteHint::of(b)), (None, None));
    }
}
