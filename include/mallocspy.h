/*
 * mallocspy.h - register a malloc spy (COM's IMallocSpy, for Linux) from C or C++.
 *
 * The spy runs around every call of the process's malloc family once mallocspy is the
 * process's allocator: libmallocspy_preload.so is in LD_PRELOAD (or the program links it, or a
 * Rust program is its own interposer). Any module may register: the executable, a library
 * preloaded beside the shim, a plugin opened with dlopen. There is one spy per process.
 *
 *     const struct mallocspy_api *api = mallocspy_api();
 *     if (api && api->register_spy(&my_vtable, my_context) == MALLOCSPY_S_OK) ...
 *
 * The contract (what runs when, what a spy may change) is the Rust crate's `MallocSpy` trait;
 * in short:
 *   - Pre methods run just before the real allocator, Post methods just after; a Pre method
 *     and its Post method run on the same thread with no other call of that thread between.
 *   - pre_alloc/pre_alloc_aligned/pre_realloc may enlarge the request (return the size to
 *     allocate); returning 0 for a non-zero request fails the call (NULL, ENOMEM; EINVAL for
 *     an alignment the real allocator rejects) and the Post method is not called. A real
 *     failure calls the Post method with NULL.
 *   - post_alloc/post_realloc return the pointer the caller gets (e.g. actual + header size);
 *     pre_free/pre_realloc/pre_get_size map it back. `spied` says whether the block was
 *     allocated while this spy was registered (i.e. has its layout).
 *   - Aligned allocations call the _aligned pair (NULL members fall back to pre_alloc and
 *     post_alloc) with the caller's alignment rounded up to a power of two, as glibc's
 *     memalign rounds it; a spy that moves pointers must keep them aligned.
 *   - State between a Pre and a Post method goes in api->call_scratch() (12 words per thread).
 *   - Allocations made by the spy itself go straight to the real allocator.
 *   - Functions are called from any thread, concurrently; they must not block.
 *   - `release` is called once, when the spy is dropped: at revoke, or after the last free of
 *     its blocks when the revoke was pending (MALLOCSPY_E_ACCESSDENIED). Until then the
 *     libraries holding the table's functions and `ctx` stay loaded, even if dlclose'd
 *     (unless the spy was registered from inside a spy function or release).
 * NULL members are pass-through.
 */
#ifndef MALLOCSPY_H
#define MALLOCSPY_H

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MALLOCSPY_ABI_VERSION 1u

/* Status codes, mirroring COM's HRESULTs. */
#define MALLOCSPY_S_OK 0                                 /* S_OK */
#define MALLOCSPY_E_OBJISREG ((int32_t)0x800401FCu)      /* CO_E_OBJISREG: a spy is registered */
#define MALLOCSPY_E_INVALIDARG ((int32_t)0x80070057u)    /* E_INVALIDARG: not a usable spy table */
#define MALLOCSPY_E_OBJNOTREG ((int32_t)0x800401FBu)     /* CO_E_OBJNOTREG: no spy registered */
#define MALLOCSPY_E_ACCESSDENIED ((int32_t)0x80070005u)  /* E_ACCESSDENIED: blocks live, revoke pending */
#define MALLOCSPY_E_NOT_INTERPOSED ((int32_t)0x80004002u) /* mallocspy is not the process's malloc */

/* The entry points, as passed in mallocspy_call.entry and before_release. New ones come at
 * the end without a change of MALLOCSPY_ABI_VERSION (the sized frees came so): a spy must
 * not index a table by an entry it does not know (MALLOCSPY_ENTRIES at the time it was
 * built), and may take any release it does not know as a free. */
enum mallocspy_entry {
    MALLOCSPY_MALLOC = 0,
    MALLOCSPY_CALLOC,
    MALLOCSPY_REALLOC,
    MALLOCSPY_REALLOCARRAY,
    MALLOCSPY_FREE,
    MALLOCSPY_POSIX_MEMALIGN,
    MALLOCSPY_ALIGNED_ALLOC,
    MALLOCSPY_MEMALIGN,
    MALLOCSPY_VALLOC,
    MALLOCSPY_PVALLOC,
    MALLOCSPY_MALLOC_USABLE_SIZE,
    MALLOCSPY_MALLOC_TRIM,
    MALLOCSPY_OPERATOR_NEW,       /* C++, every form (nothrow, aligned) */
    MALLOCSPY_OPERATOR_NEW_ARRAY,
    MALLOCSPY_OPERATOR_DELETE,    /* C++, every form (sized, nothrow, aligned) */
    MALLOCSPY_OPERATOR_DELETE_ARRAY,
    MALLOCSPY_FREE_SIZED,         /* C23 */
    MALLOCSPY_FREE_ALIGNED_SIZED, /* C23 */
    MALLOCSPY_ENTRIES             /* how many this header knows */
};

/* One completed call, as the caller saw it (after_call). */
struct mallocspy_call {
    uint8_t entry;  /* enum mallocspy_entry */
    size_t size;    /* bytes asked for (calloc: the product) */
    size_t align;   /* alignment asked for, 0 for the unaligned functions */
    void *ptr;      /* block passed in (free, realloc, malloc_usable_size) */
    void *result;   /* block handed back */
    uint8_t failed; /* 1: the call reported an error */
};

struct mallocspy_spy_vtable {
    uint32_t version; /* MALLOCSPY_ABI_VERSION */
    uint32_t size;    /* sizeof(struct mallocspy_spy_vtable) */
    size_t (*pre_alloc)(void *ctx, size_t size);
    void *(*post_alloc)(void *ctx, void *actual);
    size_t (*pre_alloc_aligned)(void *ctx, size_t size, size_t align);
    void *(*post_alloc_aligned)(void *ctx, void *actual, size_t align);
    void *(*pre_free)(void *ctx, void *request, int spied);
    void (*post_free)(void *ctx, int spied);
    size_t (*pre_realloc)(void *ctx, void *request, size_t size, void **new_request, int spied);
    void *(*post_realloc)(void *ctx, void *actual, int spied);
    void *(*pre_get_size)(void *ctx, void *request, int spied);
    size_t (*post_get_size)(void *ctx, size_t actual, int spied);
    void *(*pre_did_alloc)(void *ctx, void *request, int spied);
    int (*post_did_alloc)(void *ctx, void *request, int spied, int actual);
    void (*pre_heap_minimize)(void *ctx);
    void (*post_heap_minimize)(void *ctx);
    void (*before_release)(void *ctx, int entry, void *ptr, int spied);
    void (*after_call)(void *ctx, const struct mallocspy_call *call);
    void (*release)(void *ctx);
    /* MALLOCSPY_OBSERVE: the spy only observes (before_release and after_call run, nothing
     * is changed or recorded, `spied` is always 0, a revoke takes effect at once); 0: it
     * interposes, like IMallocSpy. Another bit: E_INVALIDARG. */
    uint32_t flags;
};

#define MALLOCSPY_OBSERVE 1u

/* Blocks and bytes. */
struct mallocspy_tally {
    uint64_t blocks;
    uint64_t bytes;
};

/* A leak check's totals (valgrind's LEAK SUMMARY). */
struct mallocspy_leak_summary {
    struct mallocspy_tally definitely_lost;
    struct mallocspy_tally indirectly_lost;
    struct mallocspy_tally possibly_lost;
    struct mallocspy_tally still_reachable;
    struct mallocspy_tally suppressed;
    uint64_t total_allocs;
    uint64_t total_frees;
    uint64_t total_bytes_allocated;
};

/* The leak tracker's heap statistics. */
struct mallocspy_heap_stats {
    uint64_t live_blocks;
    uint64_t live_bytes;
    uint64_t peak_bytes;
    uint64_t total_allocs;
    uint64_t total_frees;
    uint64_t total_bytes;
};

/* A sampled allocation (GCAllocationTick_V3 for malloc). */
struct mallocspy_allocation_tick {
    uint64_t time_ns;         /* since the spy started */
    uint32_t thread;          /* the allocating thread's index (the heap index) */
    uint8_t kind;             /* 0 small, 1 large (>= 128 KiB), 2 aligned (memalign family) */
    uint8_t entry;            /* enum mallocspy_entry: an allocating one */
    uint64_t size;            /* bytes asked for */
    uint64_t address;         /* the block */
    uint64_t weight;          /* bytes this sample stands for: sums estimate true totals */
    const uint64_t *frames;   /* return addresses, innermost first, valid during the call */
    size_t frame_count;
};

/* Per-kind figures of a heap statistics event (small, large, aligned). */
struct mallocspy_kind_stats {
    uint64_t live_bytes;  /* estimated from the live samples */
    uint64_t live_blocks; /* estimated likewise */
    uint64_t allocs;      /* exact */
    uint64_t bytes;       /* exact */
};

/* A heap statistics event (GCHeapStats_V2 for malloc). */
struct mallocspy_heap_stats_event {
    uint64_t time_ns;
    struct mallocspy_kind_stats kinds[3];
    uint64_t frees;
    uint64_t peak_live_bytes;
    uint64_t arena_bytes;   /* mallinfo2: arena */
    uint64_t mmapped_bytes; /* hblkhd */
    uint64_t free_bytes;    /* fordblks */
    uint64_t in_use_bytes;  /* uordblks */
    uint64_t own_bytes;     /* mallocspy's own memory */
};

/* The leak tracker's own memory (mallocspy's pool, never the watched heap). */
struct mallocspy_tracker_memory {
    uint64_t live_blocks;
    uint64_t table_bytes;
    uint64_t stacks;
    uint64_t stack_bytes;
    uint64_t pool_bytes;
};

struct mallocspy_api {
    uint32_t version; /* MALLOCSPY_ABI_VERSION */
    uint32_t size;    /* sizeof(struct mallocspy_api) */
    /* CoRegisterMallocSpy: S_OK, E_OBJISREG, E_INVALIDARG, E_NOT_INTERPOSED. */
    int32_t (*register_spy)(const struct mallocspy_spy_vtable *vtable, void *ctx);
    /* CoRevokeMallocSpy: S_OK, E_OBJNOTREG, E_ACCESSDENIED (pending until the last free;
     * from the spy's own pre/post_alloc or pre/post_realloc, the block that call returns counts).
     * It waits for the spy's functions running on other threads to return: not to be called
     * holding a lock one of them takes. */
    int32_t (*revoke_spy)(void);
    /* IMalloc::DidAlloc: 1 a live block, 0 not a block, -1 cannot tell. */
    int (*did_alloc)(void *ptr);
    /* The calling thread's 12 scratch words, private from a Pre method to its Post method. */
    uint64_t *(*call_scratch)(void);
    /* 1 when this interposer is the process's allocator (never under valgrind, whose
       replacements serve the malloc family). */
    int (*is_active)(void);
    /* The leak tracker (spy=leaks): S_OK, or E_OBJNOTREG when no tracker runs. */
    int32_t (*heap_stats)(struct mallocspy_heap_stats *out);
    /* A leak check now: the report goes to the log, the totals to *out. */
    int32_t (*leak_check)(struct mallocspy_leak_summary *out);
    int32_t (*tracker_memory)(struct mallocspy_tracker_memory *out);
    /* The ticks spy (spy=ticks): calls `callback` for every sampled allocation, inside the
     * allocator (its allocations go straight to the real allocator, neither sampled nor
     * counted; a sampled block it frees ends its sample; it must not block, and it must
     * return: left by longjmp or an exception, the hook it ran in is abandoned half done,
     * and its thread's calls go unspied from then on, the process's exit without a report).
     * NULL clears it. S_OK, or E_OBJNOTREG when no ticks spy runs. The library holding
     * `callback` stays loaded until the process ends. */
    int32_t (*on_allocation_tick)(void (*callback)(const struct mallocspy_allocation_tick *tick));
    /* Calls `callback` with every heap statistics event (at the first sampled allocation once
     * stats_interval_ms has passed, and at exit), inside the allocator like the tick callback. */
    int32_t (*on_heap_stats)(void (*callback)(const struct mallocspy_heap_stats_event *stats));
    /* Called by a spy's function, on its thread, when it cannot do its work: what it returns
     * is not used, the call goes on as without the spy, and the spy is revoked. */
    void (*spy_failed)(void);
    /* Number of live blocks allocated under the current spy, or under a revoked one whose
     * revoke is pending (it ends at the last one's free). */
    uint64_t (*spied_blocks)(void);
};

/* The active interposer's API, or NULL when mallocspy is not the process's allocator (as
   under valgrind). */
static inline const struct mallocspy_api *mallocspy_api(void)
{
    const struct mallocspy_api *api = (const struct mallocspy_api *)dlsym(RTLD_DEFAULT, "mallocspy_api_v1");
    if (!api || api->version != MALLOCSPY_ABI_VERSION || api->size < sizeof(struct mallocspy_api) || !api->is_active())
        return NULL;
    return api;
}

#ifdef __cplusplus
}
#endif

#endif /* MALLOCSPY_H */
