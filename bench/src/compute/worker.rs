//! The worker the benchmark runs under the shim: it reaches the driver as CUDA programs do,
//! through `libcuda.so.1` (the emulator's, or a real GPU's with `iterations`), and prints what
//! it did as JSON.

use std::ffi::{CString, c_int, c_uint, c_void};
use std::time::{Duration, Instant};

use gpuslice_contract::cuda::{
    Handle, LaunchConfig, LaunchCooperativeKernelFn, LaunchKernelExFn, LaunchKernelFn,
};
use gpuslice_emulator::timeline::now_ns;

/// What one worker does; its command line (`gpuslice bench compute-worker`).
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct Plan {
    #[arg(long)]
    pub kernel_us: u64,
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    #[arg(long)]
    pub busy_ms: Option<u64>,
    #[arg(long, default_value_t = 0)]
    pub idle_ms: u64,
    /// Launch CUDA graphs of this many kernels.
    #[arg(long)]
    pub graph: Option<u32>,
    #[arg(long)]
    pub cooperative: bool,
    /// Launch with cuLaunchKernelEx.
    #[arg(long)]
    pub ex: bool,
    /// Launch this many kernels as fast as possible and report the rate.
    #[arg(long)]
    pub launches: Option<u64>,
    /// Stop after this many kernels instead of after `seconds` (a job of fixed work).
    #[arg(long)]
    pub kernels: Option<u64>,
    /// On a real GPU: the busy loop's iterations per kernel (from `calibrate`); without it
    /// the emulator's timed kernel is launched.
    #[arg(long)]
    pub iterations: Option<u64>,
    /// Find `iterations` for `kernel_us` on this GPU and report it (real GPUs only).
    #[arg(long)]
    pub calibrate: bool,
    /// Start working at this CLOCK_MONOTONIC time (ns), once set up, so workers that take
    /// different times to start all start together.
    #[arg(long)]
    pub start_at: Option<u64>,
}

/// A kernel for real GPUs: `iterations` dependent FMAs on one thread, so its time is work
/// the GPU does (not a clock it watches, which would keep running while another context
/// has the GPU). The store never happens; it keeps the loop from being optimised away.
const WORK_PTX: &str = concat!(
    ".version 7.0\n.target sm_70\n.address_size 64\n",
    ".visible .entry work(.param .u64 work_iterations, .param .u64 work_sink)\n{\n",
    "  .reg .pred %p<3>;\n  .reg .f32 %f<2>;\n  .reg .b64 %rd<5>;\n",
    "  ld.param.u64 %rd1, [work_iterations];\n  ld.param.u64 %rd2, [work_sink];\n",
    "  mov.u64 %rd3, 0;\n  mov.f32 %f1, 0f3F800000;\n",
    "  setp.eq.u64 %p1, %rd1, 0;\n  @%p1 bra DONE;\n",
    "LOOP:\n  fma.rn.f32 %f1, %f1, 0f3F7FF972, 0f3A83126F;\n  add.u64 %rd3, %rd3, 1;\n",
    "  setp.lt.u64 %p1, %rd3, %rd1;\n  @%p1 bra LOOP;\n",
    "DONE:\n  setp.eq.f32 %p2, %f1, 0f7F800000;\n  @!%p2 bra END;\n",
    "  cvta.to.global.u64 %rd4, %rd2;\n  st.global.f32 [%rd4], %f1;\n",
    "END:\n  ret;\n}\n\0",
);

struct Driver {
    _lib: libloading::Library,
    launch: LaunchKernelFn,
    cooperative: LaunchCooperativeKernelFn,
    launch_ex: LaunchKernelExFn,
    sync: unsafe extern "C" fn(Handle) -> c_int,
    event_record: unsafe extern "C" fn(Handle, Handle) -> c_int,
    event_sync: unsafe extern "C" fn(Handle) -> c_int,
    begin_capture: unsafe extern "C" fn(Handle, c_int) -> c_int,
    end_capture: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    instantiate: unsafe extern "C" fn(*mut Handle, Handle, u64) -> c_int,
    graph_launch: unsafe extern "C" fn(Handle, Handle) -> c_int,
    /// The real-GPU kernel's iterations; `None` for the emulator's parameterless kernel.
    iterations: std::cell::Cell<Option<u64>>,
}

/// The function `lib` exports as `name`, typed by where it goes; returns the error if it has none.
macro_rules! sym {
    ($lib:ident, $name:literal) => {
        // SAFETY: the driver's exported function of this name, with its C signature.
        *unsafe { $lib.get($name) }.map_err(|e| format!("{}", e))?
    };
}

impl Driver {
    /// The entry points a worker launches, synchronises and captures with, from `lib`.
    fn load(lib: libloading::Library, iterations: Option<u64>) -> Result<Driver, String> {
        Ok(Driver {
            launch: sym!(lib, b"cuLaunchKernel\0"),
            cooperative: sym!(lib, b"cuLaunchCooperativeKernel\0"),
            launch_ex: sym!(lib, b"cuLaunchKernelEx\0"),
            sync: sym!(lib, b"cuStreamSynchronize\0"),
            event_record: sym!(lib, b"cuEventRecord\0"),
            event_sync: sym!(lib, b"cuEventSynchronize\0"),
            begin_capture: sym!(lib, b"cuStreamBeginCapture_v2\0"),
            end_capture: sym!(lib, b"cuStreamEndCapture\0"),
            instantiate: sym!(lib, b"cuGraphInstantiateWithFlags\0"),
            graph_launch: sym!(lib, b"cuGraphLaunch\0"),
            iterations: std::cell::Cell::new(iterations),
            _lib: lib,
        })
    }

    /// Calls `f` with the kernel's parameter array (null for the emulator's kernel).
    fn with_params<R>(&self, f: impl FnOnce(*mut *mut c_void) -> R) -> R {
        match self.iterations.get() {
            None => f(std::ptr::null_mut()),
            Some(mut iterations) => {
                let mut sink: u64 = 0;
                let mut params: [*mut c_void; 2] =
                    [(&raw mut iterations).cast(), (&raw mut sink).cast()];
                f(params.as_mut_ptr())
            }
        }
    }

    /// One single-thread-block launch of `function` on `stream`.
    ///
    /// # Safety
    /// `function` and `stream` are this process's, from the driver.
    unsafe fn launch_one(&self, function: Handle, stream: Handle) -> c_int {
        self.with_params(|params| {
            // SAFETY: the caller's function and stream; the parameters live through the call,
            // which copies them.
            unsafe {
                (self.launch)(
                    function,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params,
                    std::ptr::null_mut(),
                )
            }
        })
    }
}

type ElapsedTime = unsafe extern "C" fn(*mut f32, Handle, Handle) -> c_int;

fn check(what: &str, rc: c_int) -> Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("{what} returned CUDA error {rc}"))
    }
}

/// Runs the plan; returns the JSON report.
pub fn run(plan: Plan) -> Result<serde_json::Value, String> {
    let session = Session::open(plan)?;
    if plan.calibrate {
        let elapsed = session
            .elapsed
            .ok_or("the driver has no cuEventElapsedTime")?;
        return calibrate(
            plan.kernel_us,
            &session.driver,
            session.function,
            session.stream,
            session.events,
            elapsed,
        );
    }
    if let Some(at) = plan.start_at {
        let now = now_ns();
        if at > now {
            std::thread::sleep(Duration::from_nanos(at - now));
        }
    }
    let started = Instant::now();
    let start_ns = now_ns();
    match plan.launches {
        Some(launches) => session.launch_rate(launches, started),
        None => session.timed(started, start_ns),
    }
}

/// The driver set up for a plan: a context, the kernel, a stream with two events, any graph.
struct Session {
    plan: Plan,
    driver: Driver,
    function: Handle,
    stream: Handle,
    /// Two steps in flight, as a training loop keeps the GPU fed: wait for the step before
    /// the one just queued.
    events: [Handle; 2],
    /// Only calibration needs it (on a real GPU); the emulator has none.
    elapsed: Option<ElapsedTime>,
    graph: Option<Handle>,
}

impl Session {
    /// Loads the driver and sets up what the plan launches, in the order the API requires.
    fn open(plan: Plan) -> Result<Session, String> {
        // SAFETY: loading the CUDA driver (here the emulator, or the real one) as programs do.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }.map_err(|e| e.to_string())?;
        let init: unsafe extern "C" fn(c_uint) -> c_int = sym!(lib, b"cuInit\0");
        let device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int =
            sym!(lib, b"cuDeviceGet\0");
        let ctx_create: unsafe extern "C" fn(*mut Handle, c_uint, c_int) -> c_int =
            sym!(lib, b"cuCtxCreate_v2\0");
        let module_load: unsafe extern "C" fn(*mut Handle, *const c_void) -> c_int =
            sym!(lib, b"cuModuleLoadData\0");
        let get_function: unsafe extern "C" fn(*mut Handle, Handle, *const i8) -> c_int =
            sym!(lib, b"cuModuleGetFunction\0");
        let stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int =
            sym!(lib, b"cuStreamCreate\0");
        let event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int =
            sym!(lib, b"cuEventCreate\0");
        // Only calibration needs it (on a real GPU); the emulator has none.
        // SAFETY: the driver's function of this name, with its C signature.
        let elapsed: Option<ElapsedTime> =
            unsafe { lib.get(b"cuEventElapsedTime\0") }.ok().map(|f| *f);
        let driver = Driver::load(lib, plan.iterations)?;
        let mut device = 0;
        let mut ctx: Handle = std::ptr::null_mut();
        let mut module: Handle = std::ptr::null_mut();
        let mut function: Handle = std::ptr::null_mut();
        let mut stream: Handle = std::ptr::null_mut();
        let mut events: [Handle; 2] = [std::ptr::null_mut(); 2];
        let real_gpu = plan.iterations.is_some() || plan.calibrate;
        let (image, name): (*const c_void, CString) = if real_gpu {
            (WORK_PTX.as_ptr().cast(), c"work".to_owned())
        } else {
            (
                c"image".as_ptr().cast(),
                CString::new(format!("sleep_{}us", plan.kernel_us)).map_err(|e| e.to_string())?,
            )
        };
        // SAFETY: driver calls with valid out-pointers, in the order the API requires.
        unsafe {
            check("cuInit", init(0))?;
            check("cuDeviceGet", device_get(&mut device, 0))?;
            check("cuCtxCreate", ctx_create(&mut ctx, 0, device))?;
            check("cuModuleLoadData", module_load(&mut module, image))?;
            check(
                "cuModuleGetFunction",
                get_function(&mut function, module, name.as_ptr()),
            )?;
            check("cuStreamCreate", stream_create(&mut stream, 0))?;
            for event in &mut events {
                check("cuEventCreate", event_create(event, 0))?;
            }
        }
        let graph = match plan.graph {
            Some(n) => Some(capture(&driver, function, stream, n)?),
            None => None,
        };
        Ok(Session {
            plan,
            driver,
            function,
            stream,
            events,
            elapsed,
            graph,
        })
    }

    /// Queues one step: the graph, or one kernel launched the plan's way.
    fn step(&self) -> Result<(), String> {
        let (driver, function, stream) = (&self.driver, self.function, self.stream);
        // SAFETY: launches of a function this process loaded, on its own stream.
        unsafe {
            match self.graph {
                Some(exec) => check("cuGraphLaunch", (driver.graph_launch)(exec, stream)),
                None if self.plan.cooperative => check(
                    "cuLaunchCooperativeKernel",
                    driver.with_params(|params| {
                        (driver.cooperative)(function, 1, 1, 1, 1, 1, 1, 0, stream, params)
                    }),
                ),
                None if self.plan.ex => {
                    let config = LaunchConfig {
                        grid: [1, 1, 1],
                        block: [1, 1, 1],
                        shared_mem_bytes: 0,
                        stream,
                        attrs: std::ptr::null_mut(),
                        num_attrs: 0,
                    };
                    check(
                        "cuLaunchKernelEx",
                        driver.with_params(|params| {
                            (driver.launch_ex)(&config, function, params, std::ptr::null_mut())
                        }),
                    )
                }
                None => check("cuLaunchKernel", driver.launch_one(function, stream)),
            }
        }
    }

    /// Waits for everything queued on the stream.
    fn sync(&self) -> Result<(), String> {
        // SAFETY: synchronising this process's own stream.
        check("cuStreamSynchronize", unsafe {
            (self.driver.sync)(self.stream)
        })
    }

    /// Queues a step and waits for the previous one; true when a step was waited for.
    fn pipelined(&self, i: u64) -> Result<bool, String> {
        self.step()?;
        let events = self.events;
        let (now, before) = (events[(i % 2) as usize], events[((i + 1) % 2) as usize]);
        // SAFETY: events this process created, recorded on its own stream.
        unsafe {
            check(
                "cuEventRecord",
                (self.driver.event_record)(now, self.stream),
            )?;
            if i > 0 {
                check("cuEventSynchronize", (self.driver.event_sync)(before))?;
            }
        }
        Ok(i > 0)
    }

    /// Launches `launches` steps, synchronising every thousand, and reports launches per second.
    fn launch_rate(&self, launches: u64, started: Instant) -> Result<serde_json::Value, String> {
        for i in 0..launches {
            self.step()?;
            if i % 1000 == 999 {
                self.sync()?;
            }
        }
        self.sync()?;
        let elapsed = started.elapsed().as_secs_f64();
        Ok(serde_json::json!({
            "pid": std::process::id(),
            "kernels": launches,
            "launchesPerSecond": launches as f64 / elapsed,
        }))
    }

    /// Works for the plan's seconds (or kernels), busily or in bursts; reports when steps ended.
    fn timed(&self, started: Instant, start_ns: u64) -> Result<serde_json::Value, String> {
        let per_step = u64::from(self.plan.graph.unwrap_or(1));
        // When each step finished (CLOCK_MONOTONIC ns): on a real GPU, what the shares are
        // measured from.
        let mut done: Vec<u64> = Vec::new();
        let deadline = started + Duration::from_secs_f64(self.plan.seconds);
        let kernels = match self.plan.busy_ms {
            None => self.busy(per_step, deadline, &mut done)?,
            Some(busy_ms) => self.bursty(busy_ms, started, deadline, &mut done)?,
        };
        Ok(serde_json::json!({
            "pid": std::process::id(),
            "kernels": kernels,
            "perStep": per_step,
            "startNs": start_ns,
            "endNs": now_ns(),
            "done": done,
        }))
    }

    /// Steps back to back until `deadline` (or the plan's kernels); returns the kernels run.
    fn busy(&self, per_step: u64, deadline: Instant, done: &mut Vec<u64>) -> Result<u64, String> {
        let more = |kernels: u64| match self.plan.kernels {
            Some(total) => kernels < total,
            None => Instant::now() < deadline,
        };
        let mut kernels = 0u64;
        let mut i = 0;
        while more(kernels) {
            if self.pipelined(i)? {
                done.push(now_ns());
            }
            i += 1;
            kernels += per_step;
        }
        self.sync()?;
        if i > 0 {
            done.push(now_ns());
        }
        Ok(kernels)
    }

    /// `busy_ms` of kernels every `busy_ms + idle_ms` from `started` until `deadline`; counts them.
    fn bursty(
        &self,
        busy_ms: u64,
        started: Instant,
        deadline: Instant,
        done: &mut Vec<u64>,
    ) -> Result<u64, String> {
        let period = Duration::from_millis(busy_ms + self.plan.idle_ms);
        let work = busy_ms * 1000 / self.plan.kernel_us.max(1);
        let mut kernels = 0u64;
        let mut period_start = started;
        while period_start < deadline {
            for i in 0..work {
                if self.pipelined(i)? {
                    done.push(now_ns());
                }
                kernels += 1;
            }
            self.sync()?;
            done.push(now_ns());
            period_start += period;
            if let Some(rest) = period_start.checked_duration_since(Instant::now()) {
                std::thread::sleep(rest);
            }
        }
        Ok(kernels)
    }
}

/// Finds the busy loop's iterations that make one kernel take `kernel_us` on this GPU,
/// alone, timed by the GPU's own events.
fn calibrate(
    kernel_us: u64,
    driver: &Driver,
    function: Handle,
    stream: Handle,
    [begin, end]: [Handle; 2],
    elapsed: ElapsedTime,
) -> Result<serde_json::Value, String> {
    const ROUNDS: u32 = 10;
    let per_kernel_ns = |iterations: u64| -> Result<f64, String> {
        driver.iterations.set(Some(iterations));
        let mut ms = 0f32;
        // SAFETY: this process's function, stream and events; `ms` outlives the call.
        unsafe {
            check("cuEventRecord", (driver.event_record)(begin, stream))?;
            for _ in 0..ROUNDS {
                check("cuLaunchKernel", driver.launch_one(function, stream))?;
            }
            check("cuEventRecord", (driver.event_record)(end, stream))?;
            check("cuEventSynchronize", (driver.event_sync)(end))?;
            check("cuEventElapsedTime", elapsed(&mut ms, begin, end))?;
        }
        Ok(f64::from(ms) * 1e6 / f64::from(ROUNDS))
    };
    let target = kernel_us as f64 * 1e3;
    // The first launches compile the PTX and raise the clocks.
    per_kernel_ns(1 << 12)?;
    let mut iterations = 1u64 << 12;
    let mut took = per_kernel_ns(iterations)?;
    while took < target / 4.0 && iterations < 1 << 40 {
        iterations *= 4;
        took = per_kernel_ns(iterations)?;
    }
    let iterations = ((iterations as f64 * target / took.max(1.0)) as u64).max(1);
    let kernel_ns = per_kernel_ns(iterations)?;
    Ok(serde_json::json!({"iterations": iterations, "kernelNs": kernel_ns.round() as u64}))
}

fn capture(driver: &Driver, function: Handle, stream: Handle, n: u32) -> Result<Handle, String> {
    let mut graph: Handle = std::ptr::null_mut();
    let mut exec: Handle = std::ptr::null_mut();
    // SAFETY: a capture of kernel launches on this process's own stream, then its graph.
    unsafe {
        check("cuStreamBeginCapture", (driver.begin_capture)(stream, 0))?;
        for _ in 0..n {
            check(
                "cuLaunchKernel (captured)",
                driver.launch_one(function, stream),
            )?;
        }
        check(
            "cuStreamEndCapture",
            (driver.end_capture)(stream, &mut graph),
        )?;
        check(
            "cuGraphInstantiate",
            (driver.instantiate)(&mut exec, graph, 0),
        )?;
    }
    Ok(exec)
}
