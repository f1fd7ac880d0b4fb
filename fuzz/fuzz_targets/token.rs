#![no_main]
//! See `tessera_fuzz::token`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::token(data));
