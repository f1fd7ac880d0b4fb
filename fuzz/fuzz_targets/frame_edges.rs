#![no_main]
//! See `tessera_fuzz::frame_edges`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| tessera_fuzz::frame_edges(data));
