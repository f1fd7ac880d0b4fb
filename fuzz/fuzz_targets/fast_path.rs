#![no_main]
//! See `tessera_fuzz::fast_path`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::fast_path(data));
