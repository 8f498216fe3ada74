#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| allocsim_fuzz::decode_replay(data));
