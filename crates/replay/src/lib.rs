//! allocsim-replay
