//! Monitoring: `cudabudget status` shows every budgeted process with its figures (and
//! only trustworthy records), the Prometheus exporter serves them in the text exposition
//! format (over TLS and with basic authentication when configured), and every denial is
//! one JSON line in the events file.

mod alerts;
mod events;
mod exporter;
mod status;
