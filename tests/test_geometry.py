"""Hand-computed checks of the OpenCOOD pose, box and range conventions in opencood_ddp.data.geometry."""
import math

import numpy as np
import pytest

from opencood_ddp.data import geometry as geo
from opencood_ddp.errors import DataError

ATOL = 1e-9


def _homogeneous(xyz):
    return np.append(np.asarray(xyz, dtype=float), 1.0)


# ------------------------------------------------------------------------------------------- poses


def test_pose_identity():
    np.testing.assert_allclose(geo.pose_to_matrix([0, 0, 0, 0, 0, 0]), np.eye(4), atol=ATOL)


def test_pose_yaw_90_and_translation():
    mat = geo.pose_to_matrix([10, 20, 1.5, 0, 90, 0])
    expected = np.array([[0, -1, 0, 10], [1, 0, 0, 20], [0, 0, 1, 1.5], [0, 0, 0, 1]], dtype=float)
    np.testing.assert_allclose(mat, expected, atol=ATOL)
    # The sensor's +x axis points along world +y.
    np.testing.assert_allclose(mat @ _homogeneous([1, 0, 0]), [10, 21, 1.5, 1], atol=ATOL)


def test_pose_pitch_and_roll_signs():
    # CARLA left-handed: pitch 90 turns +x to +z; roll 90 turns +y to -z (upstream x_to_world).
    pitch = geo.pose_to_matrix([0, 0, 0, 0, 0, 90])
    np.testing.assert_allclose(pitch[:3, 0], [0, 0, 1], atol=ATOL)
    roll = geo.pose_to_matrix([0, 0, 0, 90, 0, 0])
    np.testing.assert_allclose(roll[:3, 1], [0, 0, -1], atol=ATOL)
    np.testing.assert_allclose(roll[:3, 2], [0, 1, 0], atol=ATOL)


def test_pose_general_is_rotation_and_vectorised():
    rng = np.random.default_rng(0)
    poses = np.column_stack([rng.uniform(-100, 100, (5, 3)), rng.uniform(-180, 180, (5, 3))])
    stacked = geo.pose_to_matrix(poses)
    assert stacked.shape == (5, 4, 4)
    for k in range(5):
        np.testing.assert_array_equal(stacked[k], geo.pose_to_matrix(poses[k]))
        rot = stacked[k, :3, :3]
        np.testing.assert_allclose(rot @ rot.T, np.eye(3), atol=1e-12)
        assert np.linalg.det(rot) == pytest.approx(1.0)


def test_pose_matches_documented_decomposition():
    roll, yaw, pitch = 12.0, -47.0, 5.5

    def rz(a):
        c, s = math.cos(a), math.sin(a)
        return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])

    def ry(a):
        c, s = math.cos(a), math.sin(a)
        return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])

    def rx(a):
        c, s = math.cos(a), math.sin(a)
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])

    expected = rz(math.radians(yaw)) @ ry(-math.radians(pitch)) @ rx(-math.radians(roll))
    mat = geo.pose_to_matrix([1, 2, 3, roll, yaw, pitch])
    np.testing.assert_allclose(mat[:3, :3], expected, atol=1e-12)


def test_pose_bad_shape():
    with pytest.raises(ValueError, match="pose"):
        geo.pose_to_matrix([1, 2, 3])


def test_x1_to_x2_hand_case():
    # Frame 1 sits at world (10, 0, 0); frame 2 at the origin, yawed 90 deg: world +x is frame-2 -y.
    mat = geo.x1_to_x2([10, 0, 0, 0, 0, 0], [0, 0, 0, 0, 90, 0])
    np.testing.assert_allclose(mat @ _homogeneous([0, 0, 0]), [0, -10, 0, 1], atol=ATOL)
    np.testing.assert_allclose(mat @ _homogeneous([1, 0, 0]), [0, -11, 0, 1], atol=ATOL)


def test_x1_to_x2_inverse_and_identity():
    p1 = [3, -4, 1.9, 1, 30, -2]
    p2 = [-20, 7, 1.7, -3, 200, 4]
    np.testing.assert_allclose(geo.x1_to_x2(p1, p2) @ geo.x1_to_x2(p2, p1), np.eye(4), atol=1e-12)
    np.testing.assert_allclose(geo.x1_to_x2(p1, p1), np.eye(4), atol=1e-12)
    stacked = geo.x1_to_x2(np.array([p1, p2]), p2)
    np.testing.assert_allclose(stacked[0], geo.x1_to_x2(p1, p2), atol=1e-12)


def test_transform_points_keeps_extra_columns_and_dtype():
    points = np.array([[1, 0, 0, 0.25], [0, 2, -1, 0.75]], dtype=np.float32)
    mat = geo.pose_to_matrix([10, 20, 1.5, 0, 90, 0])
    out = geo.transform_points(points, mat)
    assert out.dtype == np.float32 and out.shape == points.shape
    np.testing.assert_allclose(out, [[10, 21, 1.5, 0.25], [8, 20, 0.5, 0.75]], atol=1e-5)
    np.testing.assert_array_equal(points[0], np.float32([1, 0, 0, 0.25]))  # input untouched
    assert geo.transform_points(np.array([[1, 2, 3]]), np.eye(4)).dtype == np.float64


# ------------------------------------------------------------------------------------------- boxes

# A car at location (5, 2, 0), centre offset +0.8 z, half sizes (2, 1, 0.75), heading world +y.
OBJ = dict(location=[5, 2, 0], center=[0, 0, 0.8], extent=[2, 1, 0.75], angle=[0, 90, 0])
# Box-frame (x, y) -> world (5 - y, 2 + x) for a 90 deg yaw; z = 0.8 -+ 0.75.
OBJ_CORNERS = np.array([
    [6, 4, 0.05], [4, 4, 0.05], [4, 0, 0.05], [6, 0, 0.05],
    [6, 4, 1.55], [4, 4, 1.55], [4, 0, 1.55], [6, 0, 1.55],
])


def test_box_corners_from_object_by_hand():
    corners = geo.box_corners_from_object(**OBJ)
    np.testing.assert_allclose(corners, OBJ_CORNERS, atol=ATOL)


def test_box_corners_from_object_vectorised():
    objs = {k: np.array([v, v]) for k, v in OBJ.items()}
    objs["location"] = np.array([[5, 2, 0], [15, 2, 0]])
    corners = geo.box_corners_from_object(**objs)
    assert corners.shape == (2, 8, 3)
    np.testing.assert_allclose(corners[0], OBJ_CORNERS, atol=ATOL)
    np.testing.assert_allclose(corners[1], OBJ_CORNERS + [10, 0, 0], atol=ATOL)


def test_corners_to_boxes_by_hand_both_orders():
    hwl = geo.corners_to_boxes(OBJ_CORNERS[None], "hwl")
    np.testing.assert_allclose(hwl, [[5, 2, 0.8, 1.5, 2, 4, math.pi / 2]], atol=ATOL)
    lwh = geo.corners_to_boxes(OBJ_CORNERS, "lwh")
    np.testing.assert_allclose(lwh, [5, 2, 0.8, 4, 2, 1.5, math.pi / 2], atol=ATOL)


def test_boxes_to_corners_by_hand_and_order():
    box_hwl = np.array([[5, 2, 0.8, 1.5, 2, 4, math.pi / 2]])
    box_lwh = np.array([[5, 2, 0.8, 4, 2, 1.5, math.pi / 2]])
    np.testing.assert_allclose(geo.boxes_to_corners(box_hwl, "hwl")[0], OBJ_CORNERS, atol=ATOL)
    np.testing.assert_allclose(geo.boxes_to_corners(box_lwh, "lwh")[0], OBJ_CORNERS, atol=ATOL)
    before = box_hwl.copy()
    geo.boxes_to_corners(box_hwl, "hwl")
    np.testing.assert_array_equal(box_hwl, before)  # never modified in place (upstream does)


def test_box_round_trip_random():
    rng = np.random.default_rng(1)
    n = 50
    boxes = np.column_stack([
        rng.uniform(-50, 50, (n, 3)), rng.uniform(0.5, 6, (n, 3)), rng.uniform(-3.0, 3.0, n),
    ])
    for order in ("hwl", "lwh"):
        back = geo.corners_to_boxes(geo.boxes_to_corners(boxes, order), order)
        np.testing.assert_allclose(back, boxes, atol=1e-9)
    corners = geo.boxes_to_corners(boxes, "hwl")
    np.testing.assert_allclose(geo.boxes_to_corners(geo.corners_to_boxes(corners)), corners, atol=1e-9)


def test_corner_order_faces():
    corners = geo.boxes_to_corners(np.array([0, 0, 0, 2, 4, 6, 0.0]), "hwl")  # l=6 along x, w=4, h=2
    np.testing.assert_allclose(corners[:4, 2], -1)  # bottom face first
    np.testing.assert_allclose(corners[4:, 2], 1)
    np.testing.assert_allclose(corners[0], [3, -2, -1])
    np.testing.assert_allclose(corners[1], [3, 2, -1])
    np.testing.assert_allclose(corners[2], [-3, 2, -1])
    np.testing.assert_allclose(corners[3], [-3, -2, -1])


def test_unknown_order():
    with pytest.raises(ValueError, match="order"):
        geo.boxes_to_corners(np.zeros((1, 7)), "xyz")
    with pytest.raises(ValueError, match="order"):
        geo.corners_to_boxes(np.zeros((1, 8, 3)), "whl")


# ------------------------------------------------------------------------------------------- masks

RANGE = [-10, -5, -3, 10, 5, 1]


def test_mask_points_by_range_is_strict():
    points = np.array([
        [0, 0, 0, 0.1],      # inside
        [10, 0, 0, 0.2],     # on x_max: dropped
        [-10, 0, 0, 0.3],    # on x_min: dropped
        [0, 4.99, 0.99, 0.4],  # inside
        [0, 0, -3, 0.5],     # on z_min: dropped
        [0, 6, 0, 0.6],      # outside
    ])
    kept = geo.mask_points_by_range(points, RANGE)
    np.testing.assert_array_equal(kept[:, 3], [0.1, 0.4])
    np.testing.assert_array_equal(geo.points_in_range_mask(points, RANGE), [1, 0, 0, 1, 0, 0])


def test_range_crop_compares_in_the_points_dtype_as_upstreams_python_float_bounds():
    """Upstream compares a float32 column with a Python float, which NumPy rounds to float32 first. float32(-40.1)
    = -40.09999847 lies inside -40.1 in float64 but on the face in float32, so upstream drops it; likewise
    float32(40.1) = 40.09999847 at x_max = 40.1. One float32 step further in stays. Float64 clouds compare in
    float64, where both points are inside."""
    lidar_range = [-40.1, -10, -3, 40.1, 10, 1]
    x = np.array([np.float32(-40.1), np.float32(40.1), np.nextafter(np.float32(-40.1), np.float32(0)),
                  np.nextafter(np.float32(40.1), np.float32(0))], dtype=np.float32)
    points = np.stack([x, np.zeros(4, np.float32), np.zeros(4, np.float32), np.arange(4, dtype=np.float32)], 1)
    assert float(x[0]) > -40.1 and float(x[1]) < 40.1  # inside, read in float64
    np.testing.assert_array_equal(geo.points_in_range_mask(points, lidar_range), [0, 0, 1, 1])
    np.testing.assert_array_equal(geo.mask_points_by_range(points, lidar_range)[:, 3], [2, 3])
    np.testing.assert_array_equal(geo.points_in_range_mask(points.astype(np.float64), lidar_range), [1, 1, 1, 1])


def test_range_and_ego_masks_drop_and_keep_non_finite_points_as_upstreams_comparisons():
    """A NaN compares false: the range crop drops a point with a NaN or infinite coordinate, the ego mask keeps it
    (it is not on the car) and the crop drops it later; float32 clouds, as read_pcd gives them."""
    points = np.array([[0, 0, 0, 1], [np.nan, 0, 0, 2], [0, np.inf, 0, 3], [0, 0, -np.inf, 4], [1, 1, 0, 5]],
                      dtype=np.float32)
    np.testing.assert_array_equal(geo.points_in_range_mask(points, RANGE), [1, 0, 0, 0, 1])
    np.testing.assert_array_equal(geo.mask_points_by_range(points, RANGE)[:, 3], [1, 5])
    np.testing.assert_array_equal(geo.ego_points_mask(points), [1, 0, 0, 1, 1])
    np.testing.assert_array_equal(geo.mask_ego_points(points)[:, 3], [2, 3])
    assert geo.mask_points_by_range(points, RANGE).dtype == np.float32


def test_mask_ego_points_inclusive_box():
    points = np.array([
        [0, 0, 50, 1],        # on the car (z ignored): removed
        [2.95, 1.1, 0, 2],    # on the corner: removed
        [-1.95, -1.1, 0, 3],  # on the other corner: removed
        [2.96, 0, 0, 4],      # just ahead: kept
        [0, -1.11, 0, 5],     # just right: kept
    ])
    np.testing.assert_array_equal(geo.mask_ego_points(points)[:, 3], [4, 5])
    np.testing.assert_array_equal(geo.ego_points_mask(points), [1, 1, 1, 0, 0])


def test_boxes_in_range_mask_all_corners_inclusive():
    boxes = np.array([
        [0, 0, -1, 2, 2, 4, 0],      # well inside
        [8, 0, -1, 2, 2, 4, 0],      # x up to exactly 10: inside (faces included)
        [8.5, 0, -1, 2, 2, 4, 0],    # one face beyond x_max: out
        [0, 0, 0.5, 2, 2, 4, 0],     # top at z 1.5 > 1: out (z is tested)
        [0, 4.5, -1, 2, 2, 4, 0],    # half outside in y: out
    ])
    mask = geo.boxes_in_range_mask(geo.boxes_to_corners(boxes, "hwl"), RANGE)
    np.testing.assert_array_equal(mask, [True, True, False, False, False])
    assert geo.boxes_in_range_mask(np.zeros((0, 8, 3)), RANGE).shape == (0,)


# ----------------------------------------------------------------------------------- ground truth


def test_project_world_objects_two_cav_frame():
    # Ego lidar at world (100, 50, 1.9) facing world +y; a second CAV's lidar 10 m east, facing +x.
    ego_pose = [100, 50, 1.9, 0, 90, 0]
    cav_pose = [110, 50, 1.9, 0, 0, 0]
    lidar_range = [-140.8, -40, -3, 140.8, 40, 1]
    vehicles = {
        # 10 m ahead of the ego, same heading: ego-frame box centre (10, 0, -1.15), yaw 0.
        7: {"location": [100, 60, 0], "center": [0, 0, 0.75], "extent": [2.2, 1, 0.75],
            "angle": [0, 90, 0], "speed": 10.0},
        # 20 m east of the ego heading east: in the ego frame at (0, -20), yaw -90 deg.
        9: {"location": [120, 50, 0.1], "center": [0.2, 0, 0.65], "extent": [2, 0.9, 0.7],
            "angle": [0, 0, 0], "speed": 0.0},
        # 50 m behind the ego in y: outside y_min = -40 for the ego, dropped.
        11: {"location": [150, 50, 0], "center": [0, 0, 0.75], "extent": [2, 1, 0.75],
             "angle": [0, 0, 0]},
    }
    boxes = geo.project_world_objects(vehicles, ego_pose, lidar_range, "hwl")
    assert list(boxes) == [7, 9]
    np.testing.assert_allclose(boxes[7], [10, 0, -1.15, 1.5, 2, 4.4, 0], atol=1e-4)
    np.testing.assert_allclose(boxes[9], [0, -20.2, -1.15, 1.4, 1.8, 4, -math.pi / 2], atol=1e-4)
    corners7 = geo.boxes_to_corners(boxes[7], "hwl")
    expected7 = [[12.2, -1, -1.9], [12.2, 1, -1.9], [7.8, 1, -1.9], [7.8, -1, -1.9],
                 [12.2, -1, -0.4], [12.2, 1, -0.4], [7.8, 1, -0.4], [7.8, -1, -0.4]]
    np.testing.assert_allclose(corners7, expected7, atol=1e-4)
    corners9 = geo.boxes_to_corners(boxes[9], "hwl")
    # Box x (east) is ego -y; box y (north) is ego +x.
    np.testing.assert_allclose(corners9[0], [-0.9, -22.2, -1.85], atol=1e-4)
    np.testing.assert_allclose(corners9[6], [0.9, -18.2, -0.45], atol=1e-4)

    # The same objects seen from the second CAV: vehicle 7 is 10 m north, 10 m west of it.
    from_cav = geo.project_world_objects(vehicles, cav_pose, lidar_range, "lwh")
    np.testing.assert_allclose(from_cav[7], [-10, 10, -1.15, 4.4, 2, 1.5, math.pi / 2], atol=1e-4)
    np.testing.assert_allclose(from_cav[9], [10.2, 0, -1.15, 4, 1.8, 1.4, 0], atol=1e-4)
    np.testing.assert_allclose(from_cav[11], [40, 0, -1.15, 4, 2, 1.5, 0], atol=1e-4)


def test_project_world_objects_matches_corner_path():
    vehicles = {1: {"location": [3, 4, 0.2], "center": [0.1, -0.2, 0.7], "extent": [2.3, 1.0, 0.8],
                    "angle": [1.5, 33, -2.0]}}
    pose = [-5, 2, 1.8, 0.5, -20, 1.0]
    box = geo.project_world_objects(vehicles, pose, [-100, -100, -10, 100, 100, 10])[1]
    world = geo.box_corners_from_object(**{k: vehicles[1][k] for k in ("location", "center", "extent", "angle")})
    in_lidar = geo.transform_points(world, np.linalg.inv(geo.pose_to_matrix(pose)))
    np.testing.assert_allclose(box, geo.corners_to_boxes(in_lidar), atol=1e-9)


def test_project_world_objects_empty_and_bad_vehicle():
    assert geo.project_world_objects({}, [0] * 6, RANGE) == {}
    with pytest.raises(DataError, match=r"f\.yaml: vehicle 4 has no 'extent'"):
        geo.project_world_objects({4: {"location": [0, 0, 0], "center": [0, 0, 0], "angle": [0, 0, 0]}},
                                  [0] * 6, RANGE, source="f.yaml")


def test_xy_distance():
    assert geo.xy_distance([3, 4, 100, 0, 0, 0], [0, 0, -5, 0, 0, 0]) == 5.0
