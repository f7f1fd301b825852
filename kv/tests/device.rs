//! Pushes from device memory (`Worker::push_device`, `pushpull_device`) with the simulated
//! device standing in for a GPU: each part travels as a device segment, staged by the TCP
//! transport, and every result is the bits a host push of the same values gives; with
//! `PS_RESEND` on (the value copied for resending) and with compression on (copied to the
//! host and quantized there). A device copy that fails is an error, not a hang.

use std::time::Duration;

use psnet_compression::CompressionParams;
use psnet_kv::KvError;
use psnet_transport::device::SimulatedDevice;

mod common;

use common::{cluster_with, on_all, Cluster};

fn grad(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + rank * 13) % 29) as f32 * 0.25 - 3.0)
        .collect()
}

fn on_device(values: &[f32]) -> SimulatedDevice {
    SimulatedDevice::new(values.iter().flat_map(|v| v.to_le_bytes()).collect(), 0)
}

/// Every worker pushes then pushpulls keys 1 (small) and 2 (sharded over both servers), from
/// the device when `device`, else from host memory; the values each worker ends with.
async fn run(c: &Cluster, device: bool, compressed: bool) -> Vec<Vec<f32>> {
    let results = on_all(&c.workers, move |w| async move {
        if compressed {
            w.set_gradient_compression(CompressionParams::two_bit(0.5).unwrap())
                .await?;
        }
        let lens = [10usize, 3000];
        for (key, &len) in [1u64, 2].iter().zip(&lens) {
            w.init(&[*key], &[&vec![0.5; len]]).await?;
        }
        let mut all = Vec::new();
        for (key, &len) in [1u64, 2].iter().zip(&lens) {
            let g = grad(w.rank() as usize, len);
            let mut out = vec![0.0; len];
            if device {
                let d = on_device(&g);
                w.push_device::<f32>(*key, &d).await?;
                w.pushpull_device::<f32>(*key, &d, &mut out).await?;
                assert!(d.copies() > 0, "the values were read from the device");
            } else {
                w.push(*key, &g).await?;
                w.pushpull(*key, &g, &mut out).await?;
            }
            all.extend(out);
        }
        Ok(all)
    })
    .await;
    results
        .into_iter()
        .map(|r| r.expect("worker ops"))
        .collect()
}

async fn compare(resend: bool, compressed: bool) {
    let mut runs = Vec::new();
    for device in [false, true] {
        let c = cluster_with(2, 2, |c| {
            let c = c.bigarray_bound(100);
            if resend {
                c.resend(Some(Duration::from_secs(1)))
            } else {
                c
            }
        })
        .await;
        runs.push(run(&c, device, compressed).await);
        c.finish().await;
    }
    let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        v.iter()
            .map(|w| w.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    assert_eq!(
        bits(&runs[1]),
        bits(&runs[0]),
        "device and host pushes differ"
    );
    // Not a test that passes on zeros: the sums moved the values.
    assert!(runs[0][0].iter().any(|&x| x != 0.5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_pushes_give_the_bits_of_host_pushes() {
    compare(false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_pushes_under_ps_resend_give_the_same_bits() {
    compare(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_device_pushes_give_the_same_bits() {
    compare(false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_device_buffers_are_errors() {
    let c = cluster_with(1, 1, |c| c).await;
    let w = &c.workers[0];
    w.init(&[1], &[&[0.0; 4]]).await.expect("init");
    // Not a whole number of f32s.
    let odd = SimulatedDevice::new(vec![0; 15], 0);
    let err = w.push_device::<f32>(1, &odd).await.expect_err("15 bytes");
    assert!(err.to_string().contains("whole number"), "{err}");
    // The wrong length for the key.
    let short = on_device(&[1.0; 3]);
    let err = w.push_device::<f32>(1, &short).await.expect_err("3 values");
    assert!(matches!(err, KvError::SizeMismatch { .. }), "{err}");
    let mut out = [0.0f32; 3];
    let right = on_device(&[1.0; 4]);
    let err = w
        .pushpull_device::<f32>(1, &right, &mut out)
        .await
        .expect_err("out of 3");
    assert!(matches!(err, KvError::SizeMismatch { .. }), "{err}");
    // A device whose copies fail: the push fails, naming the device.
    let broken = on_device(&[1.0; 4]);
    let broken = SimulatedDevice::new(broken.bytes().to_vec(), 3).failing_from(0);
    let err = w
        .push_device::<f32>(1, &broken)
        .await
        .expect_err("copy fails");
    assert!(err.to_string().contains("GPU 3"), "{err}");
    // Nothing of it reached the server, and the job goes on.
    w.push_device::<f32>(1, &right).await.expect("a good push");
    let mut got = [0.0f32; 4];
    w.pull(1, &mut got).await.expect("pull");
    assert_eq!(got, [1.0; 4]);
    c.finish().await;
}
