//! NVML event sets, for XID critical errors: what the agent (and monitoring tools) listen to.
//! An XID is injected into the device model (`Machine::inject_xid`, from a test or a fault
//! script); every event set registered for that GPU then delivers it once, in order, from
//! `nvmlEventSetWait_v2`. A set remembers, per GPU, how many of its XIDs it has delivered;
//! registering starts from the XIDs reported so far (earlier errors are not events).

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_ulonglong};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlEventTypeXidCriticalError, nvmlReturn_t,
};

use crate::{
    INVALID_ARGUMENT, NOT_SUPPORTED, device_handle, device_index, guard, mig_device_parts, put,
    read,
};

const TIMEOUT: nvmlReturn_t = 10;
/// How often a wait looks at the device model.
const POLL: Duration = Duration::from_millis(10);
/// The instance ids of an event that concerns the whole GPU.
const NO_INSTANCE: c_uint = u32::MAX;

/// An event set: per GPU registered, how many of its XIDs were delivered.
struct EventSet {
    delivered: Mutex<BTreeMap<u32, usize>>,
}

fn set_of<'a>(set: nvmlEventSet_t) -> Result<&'a EventSet, nvmlReturn_t> {
    if set.is_null() {
        return Err(INVALID_ARGUMENT);
    }
    // SAFETY: event sets are only made by nvmlEventSetCreate (a leaked Box<EventSet>) and stay
    // valid until nvmlEventSetFree, which NVML's API forbids using them after.
    Ok(unsafe { &*set.cast::<EventSet>() })
}

fn xids(gpu: u32) -> Result<Vec<gpuslice_emulator::Xid>, nvmlReturn_t> {
    read(|m| Ok(m.gpu(gpu)?.xid_events.clone()))
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        let made = Box::into_raw(Box::new(EventSet {
            delivered: Mutex::new(BTreeMap::new()),
        }));
        put(set, made.cast())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> nvmlReturn_t {
    guard(|| {
        set_of(set)?;
        // SAFETY: made by nvmlEventSetCreate with Box::into_raw; the caller gives it up here.
        drop(unsafe { Box::from_raw(set.cast::<EventSet>()) });
        Ok(())
    })
}

/// XID critical errors, on whole GPUs (a MIG device's errors come on its GPU).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> nvmlReturn_t {
    guard(|| {
        if mig_device_parts(device).is_some() {
            return Err(NOT_SUPPORTED);
        }
        xids(device_index(device)?)?;
        put(types, c_ulonglong::from(nvmlEventTypeXidCriticalError))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> nvmlReturn_t {
    guard(|| {
        let set = set_of(set)?;
        if mig_device_parts(device).is_some()
            || types & !c_ulonglong::from(nvmlEventTypeXidCriticalError) != 0
        {
            return Err(NOT_SUPPORTED);
        }
        let gpu = device_index(device)?;
        let so_far = xids(gpu)?.len();
        if types != 0 {
            set.delivered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(gpu)
                .or_insert(so_far);
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> nvmlReturn_t {
    guard(|| {
        let set = set_of(set)?;
        if data.is_null() {
            return Err(INVALID_ARGUMENT);
        }
        let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
        loop {
            let gpus: Vec<(u32, usize)> = set
                .delivered
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|(g, n)| (*g, *n))
                .collect();
            for (gpu, delivered) in gpus {
                if let Some(xid) = xids(gpu)?.get(delivered).copied() {
                    set.delivered
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(gpu, delivered + 1);
                    return put(
                        data,
                        nvmlEventData_t {
                            device: device_handle(gpu),
                            eventType: c_ulonglong::from(nvmlEventTypeXidCriticalError),
                            eventData: xid.code,
                            // A MIG instance's error names it (its one compute instance is 0).
                            gpuInstanceId: xid.gpu_instance.unwrap_or(NO_INSTANCE),
                            computeInstanceId: xid.gpu_instance.map_or(NO_INSTANCE, |_| 0),
                        },
                    );
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TIMEOUT);
            }
            std::thread::sleep(POLL.min(deadline - now));
        }
    })
}
