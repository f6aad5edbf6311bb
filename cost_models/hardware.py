"""Hardware profiles: the measured or documented speeds of one kind of device.

A profile is a JSON file in which every number is ``{"value": ..., "source": "..."}``
so that a reviewer sees where it came from. Shipped profiles live in ``profiles/``;
``Cluster(profile="path.json")`` loads a user's own. :func:`load_profile` reads one by
name or path into a :class:`HardwareProfile` (:func:`parse_profile` from text;
:func:`available_profiles` names the shipped ones); :func:`profile_from_measured`
takes a file written by ``autopar profile`` over a base profile.

What a profile may hold (measured tables, a ``base`` profile it changes, a measured
file as a profile) and where each field's source comes from: docs/cost_models.md,
section ``autopar.cost_models.hardware``.
"""

from __future__ import annotations

from autopar.cost_models.hardware_parse import (ALIASES, MEASURED_FORMAT, accuracy_text,
                                                available_profiles, load_profile, parse_profile,
                                                profile_from_measured, published_runs_text,
                                                warn_other_torch)
from autopar.cost_models.hardware_spec import (CPU_PROFILE_NOTE, CollectiveAlgorithm,
                                               HardwareProfile, LinkSpec)

__all__ = ["ALIASES", "CPU_PROFILE_NOTE", "MEASURED_FORMAT", "CollectiveAlgorithm",
           "HardwareProfile", "LinkSpec", "accuracy_text", "available_profiles", "load_profile",
           "parse_profile", "profile_from_measured", "published_runs_text", "warn_other_torch"]
