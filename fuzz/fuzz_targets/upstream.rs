#![no_main]
//! See `tessera_fuzz::upstream`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::upstream(data));
