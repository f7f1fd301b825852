//! Device discovery against the host's real libibverbs and sysfs. In the Soft-RoCE guest
//! (`scripts/rxe-vm`, whose hook sets `RXE_DEV` and `RXE_NETDEV`) the device must be found
//! both ways; elsewhere the absence must be a clear reason, never a panic.

use psnet_config::env::harness_var;
use psnet_verbs::devices::verbs_devices;
use psnet_verbs::discovery::rdma_device_for_interface;

#[test]
fn devices_are_listed_or_their_absence_explained() {
    let expected = harness_var("RXE_DEV");
    match verbs_devices() {
        Ok(devices) => {
            for d in &devices {
                println!("libibverbs device {} (node GUID {})", d.name, d.guid);
            }
            if let Some(dev) = &expected {
                assert!(
                    devices.iter().any(|d| &d.name == dev),
                    "{dev} not in {devices:?}"
                );
            }
        }
        Err(reason) => {
            assert!(
                expected.is_none(),
                "the guest has {expected:?} but libibverbs says: {reason}"
            );
            assert!(reason.to_string().contains("no RDMA devices here"));
            eprintln!("SKIPPED: {reason}");
        }
    }
}

#[test]
fn the_guest_interface_maps_to_its_soft_roce_device() {
    let (Some(dev), Some(netdev)) = (harness_var("RXE_DEV"), harness_var("RXE_NETDEV")) else {
        eprintln!("SKIPPED: not in the Soft-RoCE guest (RXE_DEV / RXE_NETDEV unset)");
        return;
    };
    let binding = rdma_device_for_interface(&netdev)
        .expect("sysfs readable")
        .unwrap_or_else(|| panic!("no RDMA device bound to {netdev}"));
    assert_eq!(binding.device, dev);
    assert_eq!(binding.link_layer, "Ethernet");
    println!(
        "{netdev} -> {} port {} ({:?})",
        binding.device, binding.port, binding.source
    );
}
