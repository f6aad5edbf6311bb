"""Measuring a machine for the cost models: ``autopar profile`` (:mod:`.run`) and the
shipped ``cpu`` profile (:mod:`.cpu`)."""
