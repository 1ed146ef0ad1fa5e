//! The command line: `cudabudget run` preloads the library and passes the budget (or
//! refuses before anything runs, with a line saying why), and `cudabudget doctor` checks
//! a machine and says what to do about each problem.

mod closed_pipe;
mod doctor;
mod node_services;
mod run;
