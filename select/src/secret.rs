//! The job's shared secret from `PSNET_SECRET` or `PSNET_SECRET_FILE`.

use std::io::Read;
use std::sync::Once;

use psnet_config::env;
use psnet_config::ConfigError;
use psnet_transport::auth::{Secret, MAX_SECRET_LEN};

/// The secret the environment names, `None` if neither variable is set. The secret's value
/// never appears in an error or a log line.
pub fn secret_from_env() -> Result<Option<Secret>, ConfigError> {
    let inline = env::PSNET_SECRET.get();
    let file = env::PSNET_SECRET_FILE.get();
    let secret = match (inline, file) {
        (None, None) => None,
        (Some(_), Some(path)) => {
            return Err(ConfigError::Invalid {
                name: env::PSNET_SECRET_FILE.name,
                value: path,
                reason: "PSNET_SECRET is set too: set only one of them".into(),
            })
        }
        (Some(text), None) => Some(Secret::new(text).map_err(|e| ConfigError::Invalid {
            name: env::PSNET_SECRET.name,
            value: "(hidden)".into(),
            reason: e.to_string(),
        })?),
        (None, Some(path)) => Some(read_secret_file(&path)?),
    };
    Ok(secret)
}

/// Reads a secret file: bounded, one trailing newline dropped, a warning if it is readable
/// by others (as ssh warns of a private key).
pub fn read_secret_file(path: &str) -> Result<Secret, ConfigError> {
    let invalid = |reason: String| ConfigError::Invalid {
        name: env::PSNET_SECRET_FILE.name,
        value: path.to_string(),
        reason,
    };
    let file = std::fs::File::open(path).map_err(|e| invalid(format!("cannot open it: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_LEN as u64 + 2)
        .read_to_end(&mut bytes)
        .map_err(|e| invalid(format!("cannot read it: {e}")))?;
    if bytes.ends_with(b"\r\n") {
        bytes.truncate(bytes.len() - 2);
    } else if bytes.ends_with(b"\n") {
        bytes.truncate(bytes.len() - 1);
    }
    let secret = Secret::new(bytes).map_err(|e| invalid(e.to_string()))?;
    warn_if_others_can_read(path);
    Ok(secret)
}

#[cfg(unix)]
fn warn_if_others_can_read(path: &str) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                path,
                mode = format!("{:o}", mode & 0o777),
                "PSNET_SECRET_FILE may be read by other users (chmod 600 it)"
            );
        }
    }
}

#[cfg(not(unix))]
fn warn_if_others_can_read(_path: &str) {}

/// Says once per process that the job is open, when it has no secret.
pub(crate) fn note_open_job(secret: Option<&Secret>, listen: std::net::IpAddr) {
    static ONCE: Once = Once::new();
    if secret.is_none() {
        ONCE.call_once(|| {
            if listen.is_loopback() {
                // Only this host reaches it: not worth a warning on every local run.
                tracing::info!(
                    "no PSNET_SECRET or PSNET_SECRET_FILE: this job is open to any process \
                     of this host"
                );
            } else {
                tracing::warn!(
                    address = %listen,
                    "no PSNET_SECRET or PSNET_SECRET_FILE: this job is open. Any process that \
                     reaches its addresses can join it and change the model, and any on the \
                     network path can read and rewrite its messages; set PSNET_SECRET_FILE on \
                     shared networks"
                );
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_secret_file_is_read_bounded_without_its_newline() {
        let dir = std::env::temp_dir().join(format!("psnet-secret-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s");
        let p = path.to_str().unwrap();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(b"hunter2\n")
            .unwrap();
        assert_eq!(
            read_secret_file(p).unwrap(),
            Secret::new("hunter2").unwrap()
        );
        std::fs::write(&path, b"hunter2\r\n").unwrap();
        assert_eq!(
            read_secret_file(p).unwrap(),
            Secret::new("hunter2").unwrap()
        );
        std::fs::write(&path, b"\n").unwrap();
        let e = read_secret_file(p).unwrap_err().to_string();
        assert!(e.contains("empty"), "{e}");
        std::fs::write(&path, vec![b'x'; MAX_SECRET_LEN + 1]).unwrap();
        let e = read_secret_file(p).unwrap_err().to_string();
        assert!(e.contains("at most"), "{e}");
        let e = read_secret_file(dir.join("missing").to_str().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("PSNET_SECRET_FILE") && e.contains("cannot open"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
