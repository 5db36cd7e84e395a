"""The attacker of the trust tests is really another user: what it can and cannot do."""

from __future__ import annotations

import os


def test_the_attacker_is_another_user_without_the_jobs_environment(attacker, public_tmp, monkeypatch):
    tmp_path = public_tmp
    monkeypatch.setenv("RESILIENT_JOB_SECRET", "x" * 64)
    secret = tmp_path / "job.secret"
    secret.write_text("not yours")
    os.chmod(secret, 0o600)
    shared = tmp_path / "readable"
    shared.write_text("public")
    os.chmod(shared, 0o644)
    r = attacker.python("""
        import os, sys
        print(os.getuid(), os.getgid(), os.getgroups(), os.environ.get("RESILIENT_JOB_SECRET"))
        print(open(sys.argv[2]).read())
        try:
            open(sys.argv[1]).read()
            print("read the secret")
        except PermissionError:
            print("refused")
    """, str(secret), str(shared))
    assert r.returncode == 0, r.stderr
    ids, public, verdict = r.stdout.splitlines()
    assert ids == f"{attacker.uid} {attacker.gid} [] None"
    assert (public, verdict) == ("public", "refused")


def test_what_the_attacker_creates_is_its_own(attacker, public_tmp):
    tmp_path = public_tmp
    os.chmod(tmp_path, 0o1777)
    r = attacker.python("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)",
                        str(tmp_path / "planted"))
    assert r.returncode == 0, r.stderr
    assert attacker.owns(tmp_path / "planted")
