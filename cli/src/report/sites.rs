//! Allocation sites: stacks grouped by where the program asked for memory.
//!
//! A stack's site is the analogue of GCAllocationTick's TypeName: its innermost frame outside
//! the allocator, the C runtime and the standard libraries' code (a `std::vector`'s growth is
//! the site of the function that pushed, not of `_M_allocate`, which every vector shares).
//! Grouping by site rather than by whole stack puts the many paths into one `parse_row`
//! together, which is what the tables rank.

use std::collections::HashMap;

use super::profile::{Figures, Profile, StackStats};
use super::symbolize::{Location, SymFrame, Symbols};

/// Modules whose frames are never a site: the C runtime, the loader, the C++ runtime, and
/// mallocspy's own shim. Matched against the start of the module's file name.
const RUNTIME_MODULES: [&str; 5] = ["libc.so", "libc-", "ld-linux", "libstdc++", "libmallocspy_preload"];

/// Functions that allocate on their caller's behalf, matched against the whole name without
/// its parameters.
const ALLOCATOR_FUNCTIONS: [&str; 16] = [
    "malloc",
    "calloc",
    "realloc",
    "reallocarray",
    "free",
    "posix_memalign",
    "aligned_alloc",
    "memalign",
    "valloc",
    "pvalloc",
    "__libc_malloc",
    "__libc_calloc",
    "__libc_realloc",
    "__libc_memalign",
    "__rust_alloc",
    "__rust_realloc",
];

/// Prefixes of allocating functions: C++'s operators and allocators (usually inlined into the
/// caller's frame, where only DWARF shows them), Rust's global allocator and the raw vector
/// growth that every `Vec` and `String` allocates through.
const ALLOCATOR_PREFIXES: [&str; 14] = [
    "operator new",
    "operator delete",
    "__gnu_cxx::new_allocator<",
    "std::__new_allocator<",
    "std::allocator<",
    "std::allocator_traits<",
    "__rust_alloc",
    "__rustc::__rust_",
    "__rdl_",
    "alloc::alloc::",
    "<alloc::alloc::Global as ",
    "alloc::raw_vec::",
    "<std::alloc::System as ",
    "std::sys::alloc::",
];

/// The allocating methods of a Rust program's own global allocator (`#[global_allocator]`, a
/// wrapper such as mallocspy's own `ExitWhenOut`), `<T as core::alloc::global::GlobalAlloc>::`
/// these: every allocation of such a program went through one, which took all its bytes.
const GLOBAL_ALLOC_METHODS: [&str; 3] = ["alloc", "alloc_zeroed", "realloc"];

fn is_global_alloc_method(bare: &str) -> bool {
    bare.starts_with('<')
        && bare
            .rsplit_once(" as core::alloc::global::GlobalAlloc>::")
            .is_some_and(|(_, m)| GLOBAL_ALLOC_METHODS.contains(&m))
}

fn is_runtime_module(name: &str) -> bool {
    RUNTIME_MODULES.iter().any(|m| name.starts_with(m))
}

/// Where the standard libraries' code comes from: C++'s headers (libstdc++'s
/// `/usr/include/c++/12/`, libc++'s `.../include/c++/v1/`) and Rust's library sources.
const LIBRARY_SOURCES: [&str; 2] = ["/include/c++/", "/rustc/"];

/// Namespaces of the standard libraries, for their code in a program without line information.
const LIBRARY_NAMESPACES: [&str; 6] = ["std::", "__gnu_cxx::", "__cxxabiv1::", "alloc::", "core::", "<alloc::"];

/// Whether `frame` is code of a standard library, such as a container's growth, inlined into
/// the program or instantiated in it: never the site, as any program's containers share it.
fn is_library_code(frame: &SymFrame) -> bool {
    match &frame.file {
        Some(file) => LIBRARY_SOURCES.iter().any(|s| file.contains(s)),
        None => LIBRARY_NAMESPACES.iter().any(|n| without_return_type(&frame.function).starts_with(n)),
    }
}

/// A demangled name without the return type that a function template's carries
/// (`void std::vector<int>::_M_realloc_insert<int const&>(...)`): what follows the last space
/// outside brackets before the parameters. An operator's symbols (`operator>`, `operator()`),
/// the type of a conversion (`operator char const*`) and Rust's `->` are not brackets;
/// `decltype (...)` is one.
fn without_return_type(name: &str) -> &str {
    /// C++'s operator symbols, each before any that begins it.
    const OPERATORS: [&str; 40] = [
        "<=>", "<<=", ">>=", "->*", "()", "[]", "<<", ">>", "<=", ">=", "==", "!=", "&&", "||", "++", "--", "+=", "-=",
        "*=", "/=", "%=", "^=", "&=", "|=", "->", "<", ">", "=", "!", "+", "-", "*", "/", "%", "^", "&", "|", "~", ",",
        "\"\"",
    ];
    // Bytes, not `str` slices: a name may hold any character (a damaged trace's), and only
    // the ASCII space where the name starts is ever cut at.
    let bytes = name.as_bytes();
    let mut depth = 0i32;
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"operator") && !bytes[..i].last().is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_')
        {
            i += "operator".len();
            if bytes[i..].starts_with(b" ") {
                // `operator new[]`, or a conversion's type (`operator char const*`): up to the
                // parameters, whatever brackets the type has.
                let mut nested = 0i32;
                while i < bytes.len() && !(bytes[i] == b'(' && nested == 0) {
                    nested += match bytes[i] {
                        b'<' => 1,
                        b'>' => -1,
                        _ => 0,
                    };
                    i += 1;
                }
            } else if let Some(symbol) = OPERATORS.iter().find(|o| bytes[i..].starts_with(o.as_bytes())) {
                // Past the operator's symbol: a template's arguments may follow (`operator>=<T>`,
                // `operator< <T>`).
                i += symbol.len();
                if *symbol == "\"\"" {
                    // A literal operator's suffix: `operator"" s`, `operator"" _km`.
                    i += usize::from(bytes[i..].starts_with(b" "));
                    while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                        i += 1;
                    }
                } else if bytes[i..].starts_with(b" <") {
                    i += 1;
                }
            }
            continue;
        }
        match bytes[i] {
            b'-' if rest.starts_with(b"->") => i += 1,
            b'<' | b'[' | b'{' => depth += 1,
            b'>' | b']' | b'}' => depth -= 1,
            b'(' if depth == 0 && i > 0 && !ends_with_word(&bytes[..i], b"decltype") => break,
            b'(' => depth += 1,
            b')' => depth -= 1,
            b' ' if depth == 0 => start = i + 1,
            _ => {}
        }
        i += 1;
    }
    &name[start..]
}

/// Whether `text`, without trailing spaces, ends with the whole word `word`.
fn ends_with_word(text: &[u8], word: &[u8]) -> bool {
    let text = text.trim_ascii_end();
    text.ends_with(word)
        && !text[..text.len() - word.len()].last().is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

fn is_allocator_function(name: &str) -> bool {
    let name = without_return_type(name);
    let bare = name.split('(').next().unwrap_or(name).trim();
    ALLOCATOR_FUNCTIONS.contains(&bare)
        || ALLOCATOR_PREFIXES.iter().any(|p| bare.starts_with(p))
        || is_global_alloc_method(bare)
}

/// Where a stack allocated: its location and the (possibly inlined) frame within it.
#[derive(Clone, Copy)]
pub struct SiteFrame<'a> {
    /// The resolved return address.
    pub location: &'a Location,
    /// The frame of it that is the site.
    pub frame: &'a SymFrame,
    /// When the site has no name (a static function of a stripped library): the nearest
    /// caller that has one, so that the site still reads as code (`sqlite3Malloc`).
    pub named_caller: Option<&'a SymFrame>,
}

/// The site of a stack; `None` for a stack with no frames (its record was lost).
pub fn site_of<'a>(stack: &StackStats, symbols: &'a Symbols) -> Option<SiteFrame<'a>> {
    let locations = || stack.frames.iter().map(|&f| symbols.location(f));
    let outside = locations().enumerate().find_map(|(i, location)| {
        if location.module.is_some_and(|m| is_runtime_module(symbols.module_name(m))) {
            return None;
        }
        let frame = location.frames.iter().find(|f| !is_allocator_function(&f.function) && !is_library_code(f))?;
        let named_caller = if location.symbolized {
            None
        } else {
            // Not the C library's: below a stripped program's frames that is its start-up code.
            locations()
                .skip(i + 1)
                .find(|l| l.symbolized && !l.module.is_some_and(|m| is_runtime_module(symbols.module_name(m))))
                .and_then(|l| l.frames.last())
        };
        Some(SiteFrame { location, frame, named_caller })
    });
    // All runtime (a libc-internal allocation): the allocator's caller is the best name left.
    outside.or_else(|| {
        let location = locations().next()?;
        Some(SiteFrame { location, frame: location.frames.last()?, named_caller: None })
    })
}

/// How a site reads in a table: `function (file:line)`, `function (module)` without line
/// information, `module+0xOFFSET` without a symbol.
pub fn label(site: Option<SiteFrame<'_>>, symbols: &Symbols) -> String {
    let Some(SiteFrame { location, frame, named_caller }) = site else { return super::profile::NOT_RECORDED.into() };
    if let Some(caller) = named_caller {
        return format!("{} (called from {})", frame.function, caller.function);
    }
    match (&frame.file, frame.line) {
        (Some(file), Some(line)) => format!("{} ({file}:{line})", frame.function),
        (Some(file), None) => format!("{} ({file})", frame.function),
        _ if location.symbolized => match location.module {
            Some(m) => format!("{} ({})", frame.function, symbols.module_name(m)),
            None => frame.function.clone(),
        },
        _ => frame.function.clone(),
    }
}

/// The stacks of one site, with their figures summed.
pub struct Site<'a> {
    /// How it reads: see [`label`].
    pub label: String,
    /// Its frame (`None` for stacks whose record was lost).
    pub frame: Option<SiteFrame<'a>>,
    /// What its stacks allocated.
    pub allocated: Figures,
    /// What was live at the peak.
    pub live_at_peak: Figures,
    /// What was live at the end.
    pub live_at_end: Figures,
    /// Its stacks (indices into [`Profile::stacks`]), most bytes allocated first.
    pub stacks: Vec<usize>,
}

/// The site of a forked child's inherited blocks, whose stacks are in the parent's trace.
pub fn inherited_label(parent: u32) -> String {
    format!("[inherited from pid {parent} at fork]")
}

/// Every site of the profile, most bytes allocated first; a forked child's inherited blocks
/// make a site of their own, which allocated nothing.
pub fn sites<'a>(profile: &Profile, symbols: &'a Symbols) -> Vec<Site<'a>> {
    let mut by_label: HashMap<String, usize> = HashMap::new();
    let mut sites: Vec<Site<'a>> = Vec::new();
    let inherited = profile.inherited.filter(|i| i.at_fork.samples > 0);
    for (i, stack) in profile.stacks.iter().enumerate() {
        let (frame, label) = match inherited {
            Some(inherited) if inherited.stack == i => (None, inherited_label(inherited.parent)),
            _ if stack.allocated.samples == 0 => continue,
            _ => {
                let frame = site_of(stack, symbols);
                (frame, label(frame, symbols))
            }
        };
        let at = *by_label.entry(label.clone()).or_insert_with(|| {
            sites.push(Site {
                label,
                frame,
                allocated: Figures::default(),
                live_at_peak: Figures::default(),
                live_at_end: Figures::default(),
                stacks: Vec::new(),
            });
            sites.len() - 1
        });
        let site = &mut sites[at];
        site.allocated.add(stack.allocated);
        site.live_at_peak.add(stack.live_at_peak);
        site.live_at_end.add(stack.live_at_end);
        site.stacks.push(i);
    }
    for site in &mut sites {
        site.stacks.sort_by_key(|&i| std::cmp::Reverse(profile.stacks[i].allocated.bytes));
    }
    sites.sort_by(|a, b| b.allocated.bytes.cmp(&a.allocated.bytes).then_with(|| a.label.cmp(&b.label)));
    sites
}

/// The `n` sites with the most bytes live at the peak (none with nothing live then).
pub fn top_live_at_peak<'s, 'a>(sites: &'s [Site<'a>], n: usize) -> Vec<&'s Site<'a>> {
    top_live(sites, n, |s| s.live_at_peak.bytes)
}

/// The `n` sites holding the most estimated live bytes at the trace's end, most first: what a
/// program that ended normally left unfreed (heaptrack's "leaked" list).
pub fn top_live_at_end<'s, 'a>(sites: &'s [Site<'a>], n: usize) -> Vec<&'s Site<'a>> {
    top_live(sites, n, |s| s.live_at_end.bytes)
}

fn top_live<'s, 'a>(sites: &'s [Site<'a>], n: usize, bytes: impl Fn(&Site<'a>) -> u64) -> Vec<&'s Site<'a>> {
    let mut live: Vec<&Site<'a>> = sites.iter().filter(|s| bytes(s) > 0).collect();
    live.sort_by(|a, b| bytes(b).cmp(&bytes(a)).then_with(|| a.label.cmp(&b.label)));
    live.truncate(n);
    live
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_functions_and_runtime_modules_are_recognized() {
        for f in [
            "malloc",
            "operator new(unsigned long)",
            "operator new[](unsigned long, std::nothrow_t const&)",
            "__gnu_cxx::new_allocator<int>::allocate(unsigned long, void const*)",
            "alloc::alloc::alloc",
            "alloc::raw_vec::finish_grow",
            "__rustc::__rust_alloc",
            "<mallocspy::out_of_memory::ExitWhenOut as core::alloc::global::GlobalAlloc>::realloc",
            "<tikv_jemallocator::Jemalloc as core::alloc::global::GlobalAlloc>::alloc_zeroed",
        ] {
            assert!(is_allocator_function(f), "{f}");
        }
        for f in [
            "parse_row",
            "mallocator",
            "std::vector<int>::push_back",
            "report::tests::allocate",
            "<app::Pool as core::alloc::global::GlobalAlloc>::layout_of",
            "<app::Arena as app::Allocator>::alloc",
        ] {
            assert!(!is_allocator_function(f), "{f}");
        }
        for m in ["libc.so.6", "libc-2.31.so", "ld-linux-x86-64.so.2", "libstdc++.so.6", "libmallocspy_preload.so"] {
            assert!(is_runtime_module(m), "{m}");
        }
        assert!(!is_runtime_module("libcrypto.so.3"));
    }

    #[test]
    fn the_standard_libraries_code_is_known_by_its_sources_or_else_its_namespace() {
        let frame = |function: &str, file: Option<&str>| SymFrame {
            function: function.into(),
            file: file.map(Into::into),
            line: None,
        };
        for f in [
            frame("std::_Vector_base<int>::_M_allocate(unsigned long)", Some("/usr/include/c++/12/bits/stl_vector.h")),
            frame("std::__1::vector<int>::__append(unsigned long)", Some("/usr/lib/llvm-16/include/c++/v1/vector")),
            frame("alloc::vec::Vec<T,A>::push", Some("/rustc/59807616e1fa/library/alloc/src/vec/mod.rs")),
            frame("std::vector<int>::_M_realloc_insert<int const&>", None),
            frame("__gnu_cxx::__verbose_terminate_handler()", None),
            // A function template's name as `__cxa_demangle` gives it, with its return type.
            frame(
                "void std::vector<int, std::allocator<int> >::_M_realloc_insert<int const&>(__gnu_cxx::__normal_iterator<int*, std::vector<int, std::allocator<int> > >, int const&)",
                None,
            ),
            frame(
                "std::shared_ptr<std::enable_if<!std::is_array<std::array<char, 200ul> >::value, std::array<char, 200ul> >::type> std::make_shared<std::array<char, 200ul>>()",
                None,
            ),
            frame(
                "decltype (__invoke((_S_declval<0ul>)())) std::thread::_Invoker<std::tuple<void (*)()> >::_M_invoke<0ul>(std::_Index_tuple<0ul>)",
                None,
            ),
            frame(
                "main::{lambda(int)#3}& std::forward<main::{lambda(int)#3}&>(std::remove_reference<main::{lambda(int)#3}&>::type&)",
                None,
            ),
            frame("std::X::operator char const*() const", None),
            frame(
                "bool std::operator< <char, std::char_traits<char> >(std::basic_string<char> const&, char const*)",
                None,
            ),
            frame("std::literals::string_literals::operator\"\" s[abi:cxx11](char const*, unsigned long)", None),
            // Any character: a damaged trace's names (slicing inside one panicked).
            frame("é std::é::operator→é<é>(é)", None),
        ] {
            assert!(is_library_code(&f), "{}", f.function);
        }
        for f in [
            frame("grow_small()", Some("/src/app.cpp")),
            frame("app::std_like()", None),
            frame("main", None),
            frame("std::vector<int> app::make<std::vector<int> >(unsigned long)", None),
            frame("app::operator<(app::Key const&, app::Key const&)", None),
            // An operator's `>` closed no bracket: the parameters were taken for the name.
            frame("app::operator>(app::Key const&, std::__cxx11::basic_string<char> )", None),
            frame("bool app::operator>=<app::Key>(app::Key const&, std::vector<int, std::allocator<int> >)", None),
            frame("<app::Cache<fn(u32) -> u32> as core::clone::Clone>::clone", None),
            frame("app::Key::operator std::__cxx11::basic_string<char>() const", None),
            frame("app::Key::operator()(std::vector<int> const&)", None),
            frame("app::Foo::not_decltype(std::vector<int> const&) const", None),
            frame("app::operator\"\" _big(unsigned long long)", None),
        ] {
            assert!(!is_library_code(&f), "{}", f.function);
        }
    }
}
