"""The shipped run configs (``configs/*.toml``), installed as the package ``resilient_configs``.

Why a package: a wheel carries files only inside packages, and ``resilient launch
configs/demo.toml`` (the README's first command) and the chaos scenarios, which name
``configs/demo.toml``, must work after ``pip install`` outside a checkout too
(:func:`resilient.shipped.shipped_config`). Nothing here is code.
"""
