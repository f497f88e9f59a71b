//! Several spies registered as one, layered: the first is outermost (closest to the caller).
//!
//! Pre methods run outside-in and Post methods inside-out, so each layer sees the request as
//! the layer above it made it: a header spy inside an observer makes the observer see the
//! caller's pointers and sizes.

use core::ffi::c_void;

use crate::spy::{Call, DidAlloc, Entry, MallocSpy, Role};

/// A stack of spies acting as one.
pub(crate) struct SpyStack {
    layers: Vec<&'static dyn MallocSpy>,
}

impl SpyStack {
    pub(crate) fn new(layers: Vec<&'static dyn MallocSpy>) -> Self {
        Self { layers }
    }
}

impl MallocSpy for SpyStack {
    fn pre_alloc(&self, size: usize) -> usize {
        self.layers.iter().try_fold(size, |s, l| Some(l.pre_alloc(s)).filter(|&n| n != 0 || s == 0)).unwrap_or(0)
    }
    fn post_alloc(&self, actual: *mut c_void) -> *mut c_void {
        self.layers.iter().rev().fold(actual, |p, l| l.post_alloc(p))
    }
    fn pre_alloc_aligned(&self, size: usize, align: usize) -> usize {
        self.layers
            .iter()
            .try_fold(size, |s, l| Some(l.pre_alloc_aligned(s, align)).filter(|&n| n != 0 || s == 0))
            .unwrap_or(0)
    }
    fn post_alloc_aligned(&self, actual: *mut c_void, align: usize) -> *mut c_void {
        self.layers.iter().rev().fold(actual, |p, l| l.post_alloc_aligned(p, align))
    }
    fn pre_free(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        self.layers.iter().fold(request, |p, l| if p.is_null() { p } else { l.pre_free(p, spied) })
    }
    fn post_free(&self, spied: bool) {
        self.layers.iter().rev().for_each(|l| l.post_free(spied))
    }
    fn pre_realloc(&self, request: *mut c_void, size: usize, spied: bool) -> (*mut c_void, usize) {
        let mut cur = (request, size);
        for l in &self.layers {
            let next = l.pre_realloc(cur.0, cur.1, spied);
            if next.1 == 0 && cur.1 != 0 {
                return (request, 0);
            }
            cur = next;
        }
        cur
    }
    fn post_realloc(&self, actual: *mut c_void, spied: bool) -> *mut c_void {
        self.layers.iter().rev().fold(actual, |p, l| l.post_realloc(p, spied))
    }
    fn pre_get_size(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        self.layers.iter().fold(request, |p, l| l.pre_get_size(p, spied))
    }
    fn post_get_size(&self, actual: usize, spied: bool) -> usize {
        self.layers.iter().rev().fold(actual, |n, l| l.post_get_size(n, spied))
    }
    fn pre_did_alloc(&self, request: *mut c_void, spied: bool) -> *mut c_void {
        self.layers.iter().fold(request, |p, l| l.pre_did_alloc(p, spied))
    }
    fn post_did_alloc(&self, request: *mut c_void, spied: bool, actual: DidAlloc) -> DidAlloc {
        self.layers.iter().rev().fold(actual, |a, l| l.post_did_alloc(request, spied, a))
    }
    fn pre_heap_minimize(&self) {
        self.layers.iter().for_each(|l| l.pre_heap_minimize())
    }
    fn post_heap_minimize(&self) {
        self.layers.iter().rev().for_each(|l| l.post_heap_minimize())
    }
    fn role(&self) -> Role {
        if self.layers.iter().all(|l| l.role() == Role::Observe) { Role::Observe } else { Role::Interpose }
    }
    fn before_alloc(&self, entry: Entry) {
        self.layers.iter().for_each(|l| l.before_alloc(entry))
    }
    fn before_release(&self, entry: Entry, ptr: *mut c_void, spied: bool) {
        self.layers.iter().for_each(|l| l.before_release(entry, ptr, spied))
    }
    fn after_call(&self, call: &Call) {
        self.layers.iter().for_each(|l| l.after_call(call))
    }
    fn served_unspied(&self, ptr: *mut c_void) {
        self.layers.iter().for_each(|l| l.served_unspied(ptr))
    }
}
