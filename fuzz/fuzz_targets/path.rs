#![no_main]
//! See `tessera_fuzz::path`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::path(data));
