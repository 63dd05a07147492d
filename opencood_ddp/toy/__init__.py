"""The synthetic toy world, written in the exact OPV2V on-disk format.

Real OPV2V cannot be downloaded here, so the demo and the tests train and evaluate on this instead: small towns
around one junction with traffic, 2-4 connected vehicles (CAVs) carrying a ray-cast rotating LiDAR, and real
occlusion, so cooperation measurably helps (docs/toy_world.md). One module per job:

- ``config``: the splits and the knobs of a set (``ToyWorldConfig``, ``LidarConfig``, the presets);
- ``world``: one scenario (junction, buildings, furniture, vehicle tracks) and its boxes and LiDAR poses at a time;
- ``lidar``: the ray caster and one LiDAR sweep; it knows no scene and no file;
- ``writer``: the OPV2V files of every split (``generate_toy_opv2v``), the frame yaml and the summary;
- ``manifest``: ``toy_manifest.yaml``, which decides whether a folder is reused, replaced or refused.

The reader (``opencood_ddp.data``) does not import any of it; this package imports the reader's pose convention
and its ``.pcd`` writer, so the files and their reading cannot disagree.
"""
