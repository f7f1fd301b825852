//! `PS_VERBOSE` onto `tracing`, as ps-lite users expect.

use tracing_subscriber::EnvFilter;

use crate::env;

/// The filter for a `PS_VERBOSE` level: 0 warnings plus the start-up transport choice,
/// 1 psnet's lifecycle (connections, roles, barriers), 2 and above every message.
pub fn filter_for_verbosity(level: u8) -> String {
    match level {
        0 => "warn,psnet_select=info".into(),
        1 => "warn,psnet=info,psnet_select=info,psnet_transport=info,psnet_fallback_tcp=info,psnet_verbs=info,psnet_kv=info,psnet_collectives=info".into(),
        _ => "info,psnet=trace,psnet_select=trace,psnet_transport=trace,psnet_fallback_tcp=trace,psnet_verbs=trace,psnet_kv=trace,psnet_collectives=trace".into(),
    }
}

/// Installs a stderr subscriber: `RUST_LOG` if set, else the filter for `PS_VERBOSE`.
/// Calling it twice is harmless. A malformed `PS_VERBOSE` is reported and treated as 0.
pub fn init() {
    let filter = match env::RUST_LOG.get() {
        Some(spec) => spec,
        None => {
            let level = env::PS_VERBOSE
                .parse_or_default::<u8>()
                .unwrap_or_else(|e| {
                    eprintln!("psnet: {e}; using PS_VERBOSE=0");
                    0
                });
            filter_for_verbosity(level)
        }
    };
    // Colour only on a terminal: logs written to a file or a pipe stay plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new(filter))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_as_filters() {
        for level in 0..=3 {
            let spec = filter_for_verbosity(level);
            assert!(EnvFilter::try_new(&spec).is_ok(), "{spec}");
        }
        assert!(filter_for_verbosity(2).contains("psnet_fallback_tcp=trace"));
    }
}
