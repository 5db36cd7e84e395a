"""resilient's chaos harness (import name ``resilient_chaos``).

Faults are data (:mod:`.scenario`); injectors make them happen and prove they
did (:mod:`.injectors` processes and etcd, :mod:`.proxy` delay/bandwidth/
resets, :mod:`.netns` partitions and loss, :mod:`.disk` full disks,
:mod:`.control` requests carried out inside the job, :mod:`.faultyfs` flaky
object storage); :mod:`.infra` sets up and tears down what a scenario needs;
:mod:`.campaign` fires the planned faults on a running job and judges it; the
merged event timeline (:mod:`.timeline`) is judged by pure property checks
(:mod:`.properties`) and summarised in a markdown + PNG report
(:mod:`.report`).

A campaign (``resilient chaos run SCENARIO --out DIR``), in order::

    sc = load_scenario(path)
    with Infra(sc, DIR / "faulted") as infra:          # netns lab, small volume, control dir
        proxy = infra.proxy("etcd", etcd_address)        # if "etcd" in sc.topology.proxy
        ... run the fault-free reference (same seed) → reference digest
        ... launch the agents with infra.launch_overrides(), expose a JobHandles
        driver = FaultDriver(sc.plan(), job).start()
        ... wait for the job to end or sc.budget to pass
        records = driver.stop()
        ... stop the job, collect the final digest
        leaks = infra.leak_kwargs()
    evaluate(sc, DIR / "faulted", records, reference=..., actual=..., leaks=leaks)
    exit(report(DIR / "faulted"))
"""
