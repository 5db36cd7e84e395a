"""resilient's chaos harness (import name ``resilient_chaos``).

Faults are data (:mod:`.scenario`); injectors make them happen and prove they
did (:mod:`.injectors` processes and etcd, :mod:`.proxy` delay/bandwidth/
resets, :mod:`.netns` partitions and loss, :mod:`.disk` full disks,
:mod:`.control` requests carried out inside the job (:mod:`.hooks`), :mod:`.faultyfs` flaky
object storage); :mod:`.infra` sets up and tears down what a scenario needs;
:mod:`.campaign` fires the planned faults on a running job and judges it; the
merged event timeline (:mod:`.timeline`) is judged by pure property checks
(:mod:`.properties`) and summarised in a markdown + PNG report
(:mod:`.report`).

A campaign is ``resilient chaos run SCENARIO [--out DIR]``
(:func:`.runner.main`; ``resilient chaos report DIR`` rewrites the report).
:mod:`.runner` trains the scenario twice with the same seed and layout —
``DIR/reference`` without faults, ``DIR/faulted`` under them — on a job of
:mod:`.jobs` (real etcd, one ``resilient launch`` agent per node), then::

    with Infra(sc, DIR / "faulted") as infra:          # netns lab, small volume, proxies, control dir
        job = LocalJob(...)                              # JobHandles: rank → pid, node → agent, shm
        driver = FaultDriver(sc.plan(), job).start()     # fires faults at their step/time
        job.wait(sc.budget); records = driver.stop()     # faults cleared before the job is stopped
    evaluate(sc, DIR / "faulted", records, reference=..., actual=..., leaks=...)
    exit(report(DIR / "faulted"))                        # 0 only when every property holds

A fail-slow drill (:mod:`.failslow_drill`: a plain data-parallel loop under ``resilient.Job``
on a process pool, slowed from outside) is what the fail-slow tests and benchmark run.

Inside the job, :mod:`.hooks` carries out bit-flip requests (the trainer
attaches it when the runner set ``RESILIENT_CHAOS_CONTROL``).
"""
